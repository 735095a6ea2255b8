"""IncrementalDetokenizer with a real byte-level BPE tokenizer (trained offline).

Properties checked: each visible text is a prefix of the next (so deltas concatenate
to the final text); no visible text ends in half a character; stop strings across
token boundaries are cut and never partly shown; EOS text is hidden.
"""

from __future__ import annotations

import random

import pytest

from engine.frontend.detokenizer import IncrementalDetokenizer, TokenTextCache
from tests.support.server_fixtures import build_tokenizer_dir


@pytest.fixture(scope="module", params=["trained-bpe", "smollm2"])
def tokenizer(request, tmp_path_factory):
    """A small BPE trained here, and the default model's own (49k-token) tokenizer."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        from engine.model_loader.source import ModelSourceError, resolve_model

        try:
            path = resolve_model(None).path
        except ModelSourceError as exc:
            pytest.skip(f"default model unavailable: {exc}")
    else:
        path = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(str(path))


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=None,
           stop_token_terminated: bool = False) -> list[str]:
    """Feed tokens in chunks; return the visible text after each chunk, then the final."""
    visible = []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(token_ids):
        size = next(sizes, 1)
        chunk = token_ids[i:i + size]
        i += size
        last = i >= len(token_ids)
        stop = detok.update(chunk, stop_token_terminated=stop_token_terminated and last)
        visible.append(detok.get_text())
        if stop is not None:
            break
    visible.append(detok.get_text(finished=True))
    return visible


def assert_prefix_chain(texts: list[str]) -> None:
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before), (before, after)


TEXTS = [
    "你好，世界！🎉🚀 天气很好 ok",
    "Emoji 👨‍👩‍👧 family, flags 🇫🇷, and ñ é ü; 日本語のテキスト。",
    "Plain ASCII only, with punctuation: (a + b) * c = d!",
    "混合 mixed 文本 🙂 with 数字 12345 and ✓ marks ✗",
]


@pytest.mark.parametrize("text", TEXTS)
def test_utf8_split_across_tokens(tokenizer, text):
    token_ids = tokenizer.encode(text)
    # The test is only meaningful if some token holds part of a character.
    pieces = [tokenizer.decode([t]) for t in token_ids]
    if "\ufffd" not in text and any(c.isascii() is False for c in text):
        assert any("\ufffd" in p for p in pieces), "expected a character split across tokens"
    visible = stream(IncrementalDetokenizer(tokenizer), token_ids)
    assert visible[-1] == text
    assert_prefix_chain(visible)
    assert not any("\ufffd" in v for v in visible)


def test_random_chunking_matches_full_decode(tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz,.!") + list("你好世界天气") + ["🎉", "🚀", "é", "ß", "∑", "👍🏽"]
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        token_ids = tokenizer.encode(text)
        sizes = [rng.randint(1, 4) for _ in token_ids]
        visible = stream(IncrementalDetokenizer(tokenizer), token_ids, sizes)
        assert visible[-1] == text
        assert_prefix_chain(visible)
        assert not any("\ufffd" in v for v in visible)


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("Hello world, ")
    output = tokenizer.encode("你好 🎉 there")
    visible = stream(IncrementalDetokenizer(tokenizer, prompt), output)
    assert visible[-1] == "你好 🎉 there"


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    token_ids = tokenizer.encode(text)
    stop = "fox jum"  # spans several tokens
    assert not any(stop in tokenizer.decode([t]) for t in token_ids)
    for sizes in ([1] * len(token_ids), [2] * len(token_ids), [3] * len(token_ids)):
        detok = IncrementalDetokenizer(tokenizer, stop=[stop])
        visible = stream(detok, token_ids, sizes)
        assert detok.stop_string == stop
        assert visible[-1] == "The quick brown "
        assert_prefix_chain(visible)
        # No part of the stop string was ever visible.
        assert all(not v.endswith("f") and "fox" not in v for v in visible)


def test_tokens_after_a_stop_string_in_one_update_are_not_kept(tokenizer):
    """Speculative decoding hands over several tokens at once: the ones after the token
    that completes a stop string are not part of the output."""
    text = "The quick brown fox jumps over the lazy dog."
    token_ids = tokenizer.encode(text)
    stop = "fox jum"
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    assert detok.update(token_ids) == stop
    kept = detok.num_tokens_kept
    assert kept < len(token_ids)
    assert stop in tokenizer.decode(token_ids[:kept])
    assert stop not in tokenizer.decode(token_ids[:kept - 1])
    assert detok.get_text() == "The quick brown "
    plain = IncrementalDetokenizer(tokenizer)
    plain.update(token_ids)
    assert plain.num_tokens_kept == len(token_ids)


def test_stop_string_inside_one_token_and_earliest_wins(tokenizer):
    text = "Hello world, hello there!"
    token_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["there", "lo w"])
    visible = stream(detok, token_ids)
    assert detok.stop_string == "lo w"
    assert visible[-1] == "Hel"


def test_include_stop_str_in_output(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    token_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["fox jum"], include_stop_str_in_output=True)
    visible = stream(detok, token_ids)
    assert visible[-1] == "The quick brown fox jum"
    assert_prefix_chain(visible)


def test_hold_back_only_what_could_start_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["xyz"])
    detok.update(tokenizer.encode("abc x"))
    assert detok.get_text() == "abc "  # "x" could begin "xyz"
    detok.update(tokenizer.encode("y"))
    assert detok.get_text() == "abc "  # "xy" too
    detok.update(tokenizer.encode("!"))
    assert detok.get_text() == "abc xy!"  # "xy!" cannot: released
    assert detok.stop_string is None


def test_unfinished_stop_prefix_released_at_finish(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["world peace"])
    detok.update(tokenizer.encode("hello world"))
    assert detok.get_text() == "hello "
    assert detok.get_text(finished=True) == "hello world"


def test_stop_strings_ignored_until_min_tokens(tokenizer):
    token_ids = tokenizer.encode("ab ab ab")
    detok = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=len(token_ids))
    stream(detok, token_ids)
    assert detok.stop_string is None


def test_eos_text_hidden_unless_included(tokenizer):
    eos = tokenizer.eos_token_id
    token_ids = tokenizer.encode("Hi there") + [eos]
    shown = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert stream(shown, token_ids, stop_token_terminated=True)[-1] == "Hi there"
    included = IncrementalDetokenizer(tokenizer, skip_special_tokens=False,
                                      include_stop_str_in_output=True)
    assert stream(included, token_ids, stop_token_terminated=True)[-1] == "Hi there<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer)
    assert stream(skipped, tokenizer.encode("<|im_start|>Hi"))[-1] == "Hi"


def test_invalid_utf8_is_flushed_at_finish(tokenizer):
    emoji = tokenizer.encode("🎉")
    assert len(emoji) >= 2
    detok = IncrementalDetokenizer(tokenizer)
    detok.update(tokenizer.encode("ok ") + emoji[:1])  # a lone lead byte
    assert detok.get_text() == "ok "
    assert detok.get_text(finished=True) == "ok \ufffd"


def test_token_text_cache(tokenizer):
    cache = TokenTextCache(tokenizer)
    token_id = tokenizer.encode("hello")[0]
    assert cache(token_id) == tokenizer.decode([token_id])
    assert cache(token_id) is cache(token_id)
