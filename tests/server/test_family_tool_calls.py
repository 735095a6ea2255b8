"""The Mistral, Phi-4-mini and Gemma 3 tool-call formats (and Magistral's reasoning)
through the whole server and the official `openai` client, over the echo FakeExecutor:
its greedy output repeats the prompt, and the chat template here renders only the last
message, so the "model" writes exactly the text a test chose.

Each tokenizer holds its family's markers as special tokens (Mistral's [TOOL_CALLS],
[THINK], [/THINK]; Phi-4-mini's <|tool_call|>, <|/tool_call|>), as the real ones do, so the
echo carries them as single special ids: the server must keep their text
(skip_special_tokens off) for the parser to see them. config.json names the family, so
`--tool-call-parser auto` picks the parser.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.server_fixtures import ServerThread, build_fake_server

ECHO_TEMPLATE = "{{ messages[-1]['content'] }}{{ eos_token }}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
FAMILIES = {
    # model_type: (special tokens (the first is EOS), reasoning parser, the model's answer,
    #              the content, the reasoning, the calls)
    "mistral": (
        ["</s>", "[TOOL_CALLS]", "[THINK]", "[/THINK]"], "mistral",
        '[THINK]Weather, then time.[/THINK]Checking. [TOOL_CALLS][{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "Checking. ", "Weather, then time.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "phi3": (
        ["<|endoftext|>", "<|tool_call|>", "<|/tool_call|>"], None,
        'One moment.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
        '<|/tool_call|>', "One moment.", None, [("get_weather", {"city": "Rome"})]),
    "gemma3_text": (
        ["<eos>"], None, '[get_weather(city="Oslo"), get_time()]', None, None,
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
}


def build_family_dir(path, model_type: str):
    """A tokenizer with the family's special tokens, the echo template and a config.json
    naming the family."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = FAMILIES[model_type][0]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(['get_weather city "Paris" arguments name'] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=specials[0],
                            pad_token=specials[0], chat_template=ECHO_TEMPLATE,
                            additional_special_tokens=specials[1:]).save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tmp_path_factory):
    model_type = request.param
    api_server = build_fake_server(build_family_dir(tmp_path_factory.mktemp(model_type),
                                                    model_type), max_model_len=512)
    api_server.options.reasoning_parser = FAMILIES[model_type][1]
    thread = ServerThread(api_server).start()
    yield model_type, thread
    thread.stop()


def test_family_tool_calls_streamed_and_not(family_server):
    model_type, thread = family_server
    _, _, answer, content, reasoning, calls = FAMILIES[model_type]
    kwargs = dict(model="fake-echo", messages=[{"role": "user", "content": answer}],
                  tools=[WEATHER, TIME], temperature=0, max_tokens=300)
    with openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0,
                       timeout=30) as client:
        choice = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == content
    assert message.model_extra.get("reasoning_content") == reasoning
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == calls
    if model_type == "mistral":  # its templates take back only 9 alphanumerics
        assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert ("".join(d.content or "" for d in deltas) or None) == content
    assert ("".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
            or None) == reasoning
    streamed: dict[int, list] = {}
    for tool_call in (t for d in deltas for t in d.tool_calls or []):
        entry = streamed.setdefault(tool_call.index, [tool_call.function.name, ""])
        entry[1] += tool_call.function.arguments or ""
    assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_plain_answers_stay_content(family_server):
    """Text without the family's call syntax comes back whole, special tokens aside."""
    _, thread = family_server
    with openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0,
                       timeout=30) as client:
        choice = client.chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "[1] Sunny, 2 < 3."}],
            tools=[WEATHER], temperature=0, max_tokens=100).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "[1] Sunny, 2 < 3."
