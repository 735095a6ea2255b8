"""Chat templates (engine/model_loader/chat_templates.py): each built-in renders its
family's documented format (written out here), the choice follows the flag, the model
and the vocabulary, and a broken template is a one-line error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.model_loader.chat_templates import (
    BUILTIN_TEMPLATES,
    ChatTemplateError,
    check_chat_template,
    choose_chat_template,
    content_format,
)
from engine.model_loader.resources import load_model_resources
from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_tokenizer

# Each family's special tokens and BOS / EOS, added to the tiny tokenizer.
FAMILY_TOKENS = {
    "gemma": (["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
    "llama3": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "chatml": (["<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "phi3": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], None, "<|endoftext|>"),
    "mistral": (["[INST]", "[/INST]"], "<s>", "</s>"),
}

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
]
# What each family's own template renders for CONVERSATION with the generation prompt.
EXPECTED = {
    "gemma": "<bos><start_of_turn>user\nYou are terse.\n\nHi.<end_of_turn>\n"
             "<start_of_turn>model\nHello.<end_of_turn>\n"
             "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse."
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi.<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n"
              "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?"
              "<|im_end|>\n<|im_start|>assistant\n",
    "phi3": "<|system|>\nYou are terse.<|end|>\n<|user|>\nHi.<|end|>\n<|assistant|>\nHello."
            "<|end|>\n<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n",
    "mistral": "<s>[INST] Hi.[/INST] Hello.</s>[INST] You are terse.\n\nWhat is 2 + 2?[/INST]",
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def family_tokenizer(name: str, with_markers: bool = True):
    tokenizer = build_tiny_tokenizer()
    markers, bos, eos = FAMILY_TOKENS[name]
    special = {"additional_special_tokens": markers if with_markers else []}
    if bos:
        special["bos_token"] = bos
    if eos:
        special["eos_token"] = eos
    tokenizer.add_special_tokens(special)
    tokenizer.chat_template = None
    return tokenizer


def render(tokenizer, template: str, conversation, tools=None) -> str:
    return tokenizer.apply_chat_template(conversation, chat_template=template, tools=tools,
                                         tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_each_builtin_renders_its_familys_format(name):
    tokenizer = family_tokenizer(name)
    template = BUILTIN_TEMPLATES[name].source
    assert render(tokenizer, template, CONVERSATION) == EXPECTED[name]
    check_chat_template(tokenizer, template, name)
    # Without a system message the first user turn carries no prefix.
    no_system = render(tokenizer, template, CONVERSATION[1:2])
    assert "You are terse." not in no_system and "Hi." in no_system


def test_chatml_renders_tools_as_qwen_and_hermes_do():
    tokenizer = family_tokenizer("chatml")
    text = render(tokenizer, BUILTIN_TEMPLATES["chatml"].source,
                  [{"role": "system", "content": "Be brief."}, *TOOL_TURNS], tools=[WEATHER_TOOL])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_llama3_renders_tools_as_json_calls_and_ipython_results():
    tokenizer = family_tokenizer("llama3")
    text = render(tokenizer, BUILTIN_TEMPLATES["llama3"].source, TOOL_TURNS, tools=[WEATHER_TOOL])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "You have access to the following functions.")
    assert json.dumps(WEATHER_TOOL, indent=4) in text
    assert ("<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", "
            "\"parameters\": {\"city\": \"Paris\"}}<|eot_id|>") in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in text


def test_gemma_refuses_turns_that_do_not_alternate():
    tokenizer = family_tokenizer("gemma")
    with pytest.raises(Exception, match="alternate"):
        render(tokenizer, BUILTIN_TEMPLATES["gemma"].source,
               [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_choice_follows_flag_model_family_and_vocabulary(tmp_path):
    gemma = family_tokenizer("gemma")
    choice = choose_chat_template(gemma, "gemma3_text")
    assert (choice.builtin, choice.stop_tokens) == ("gemma", ("<end_of_turn>",))
    assert choice.source == "built-in gemma (the model has none)"
    # A Llama-architecture model with ChatML tokens (SmolLM): ChatML, not Llama 3's.
    assert choose_chat_template(family_tokenizer("chatml"), "llama").builtin == "chatml"
    # A Gemma without Gemma's turn tokens: not Gemma's template (this vocabulary has
    # ChatML's tokens, so ChatML); with no built-in's markers at all, no template.
    assert choose_chat_template(family_tokenizer("gemma", with_markers=False),
                                "gemma3").builtin == "chatml"
    bare = SimpleNamespace(chat_template=None, get_vocab=lambda: {"a": 0, "<bos>": 1})
    assert choose_chat_template(bare, "gemma3").template is None
    # The model's own template wins over a built-in; the flag over both.
    own = build_tiny_tokenizer()
    assert choose_chat_template(own, "qwen2").source == "the model's"
    path = tmp_path / "custom.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert choose_chat_template(own, "qwen2", str(path)).template == path.read_text()
    assert choose_chat_template(own, None, "{{ 'x' }}").source == "--chat-template (inline)"
    assert choose_chat_template(gemma, None, "gemma").builtin == "gemma"


def test_flag_mistakes_are_one_line_errors(tmp_path):
    tokenizer = build_tiny_tokenizer()
    with pytest.raises(ChatTemplateError, match="not a file, a built-in"):
        choose_chat_template(tokenizer, None, "no-such-template.jinja")
    with pytest.raises(ChatTemplateError, match="vocabulary has no <start_of_turn>"):
        choose_chat_template(tokenizer, None, "gemma")
    broken = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"line 2") as caught:
        check_chat_template(tokenizer, broken, "--chat-template x")
    assert "\n" not in str(caught.value)
    with pytest.raises(ChatTemplateError, match="renders nothing"):
        check_chat_template(tokenizer, "{% if false %}x{% endif %}", "--chat-template x")


def test_content_format_auto_detects_templates_that_loop_over_parts():
    assert content_format("{% for part in message['content'] %}{{ part.text }}{% endfor %}") \
        == "openai"
    assert content_format("{{ message['content'] }}") == "string"
    assert content_format("{{ message['content'] }}", "openai") == "openai"
    assert content_format(BUILTIN_TEMPLATES["gemma"].source) == "string"


def test_resources_choose_a_builtin_for_a_model_without_a_template(tmp_path):
    """A checkpoint whose tokenizer_config.json lost its template, a Qwen2 config and
    ChatML tokens: the built-in chatml, and <|im_end|> stops requests."""
    model_dir = build_tiny_checkpoint(tmp_path, "qwen2")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    resources = load_model_resources(model_dir)
    assert resources.chat_template_source == "built-in chatml (the model has none)"
    assert resources.chat_template == BUILTIN_TEMPLATES["chatml"].source
    im_end = resources.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in [resources.eos_token_id, *resources.extra_stop_token_ids]
    custom = tmp_path / "custom.jinja"
    custom.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    resources = load_model_resources(model_dir, str(custom))
    assert resources.chat_template_source == f"--chat-template {custom}"
    with pytest.raises(ChatTemplateError, match="line 1"):
        load_model_resources(model_dir, "{% for m in messages %}")
