"""Gemma's and Phi-3's chat templates and end-of-turn tokens through the OpenAI chat
endpoint, on the echo server (greedy output token k = prompt token k).

Each tokenizer is built offline in its family's shape: its own special tokens, its
chat template, an EOS that is not the end-of-turn token, and a generation_config.json
whose `eos_token_id` list adds the end-of-turn token (as the real checkpoints ship:
Gemma 3 [<eos>, <end_of_turn>], Phi-3 [<|endoftext|>, <|end|>]). Echoing the rendered
prompt, the reply reaches the user turn's end-of-turn token and must stop there.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.server_fixtures import start_fake_server

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content']"
    " + '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% endif %}")
FAMILIES = {
    # name: (special tokens, bos, eos, end-of-turn token, template)
    "gemma3": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>",
               "<eos>", "<end_of_turn>", GEMMA_TEMPLATE),
    "phi3": (["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], None,
             "<|endoftext|>", "<|end|>", PHI3_TEMPLATE),
}


def build_family_tokenizer(path, family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, end_of_turn, template = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["Hello there, how are you? user model assistant"] * 10,
                                  trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                   pad_token=specials[0], chat_template=template,
                                   additional_special_tokens=[end_of_turn])
    fast.save_pretrained(str(path))
    eos_ids = [fast.convert_tokens_to_ids(eos), fast.convert_tokens_to_ids(end_of_turn)]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return path, eos_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_stops_at_the_end_of_turn_token(family, tmp_path):
    tokenizer_dir, (eos_id, end_of_turn_id) = build_family_tokenizer(tmp_path, family)
    thread = start_fake_server(tokenizer_dir, served_model_name=family)
    try:
        tokenizer = thread.server.state.tokenizer
        messages = [{"role": "user", "content": "Hello there"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        rendered = tokenizer(text, add_special_tokens=False).input_ids  # as the server does
        # The echo reaches the user turn's end-of-turn token first: the reply stops there.
        stop_at = rendered.index(end_of_turn_id)
        assert eos_id not in rendered[:stop_at]
        with openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0,
                           timeout=30) as client:
            reply = client.chat.completions.create(model=family, messages=messages,
                                                   max_tokens=40, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert reply.usage.completion_tokens == stop_at + 1  # the stop token counts
        assert reply.usage.prompt_tokens == len(rendered)
        assert choice.message.content == tokenizer.decode(rendered[:stop_at],
                                                          skip_special_tokens=True)
        assert "Hello there" in choice.message.content
    finally:
        thread.stop()
