"""Incremental, UTF-8-safe detokenization with stop strings.

One `IncrementalDetokenizer` per sequence. Contract:
  * `update(new_token_ids, ...)` decodes new tokens and checks stop strings; it
    returns the stop string that matched (the sequence must then be stopped) or None.
    Tokens after the one that completed a stop string are not output:
    `num_tokens_kept` counts the last update's tokens that are.
  * `get_text(finished)` is the text a client may see so far. Across calls it only
    grows (each result is a prefix of the next), so streamed deltas concatenate to the
    final text. It never ends in half a character: a token that ends inside a
    multi-byte UTF-8 character is held until the character completes. While a stop
    string is excluded from the output, the longest suffix that could still begin a
    stop string is held back too, so no part of a stop string is ever shown.

Decoding works on a sliding window (the approach of HF's TextStreamer): decode
`tokens[prefix_offset:]` and `tokens[prefix_offset:read_offset]` and emit the
difference once it no longer ends in U+FFFD.

    tokens:  ... [prefix_offset ........ read_offset ........ len]
                  already emitted, kept   new, not yet emitted
                  as decoding context
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context, so the first output token decodes with its leading
# space (SentencePiece drops a leading space on a sequence's first token).
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes (4 byte tokens): past that, a trailing U+FFFD
# is real (invalid bytes from the model), so emit it rather than grow the window.
_MAX_PENDING_TOKENS = 4


_RUST_DECODERS: dict[type, bool] = {}


def _rust_decoder(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose class
    decodes through it unchanged, else None.

    transformers' fast `decode(ids, skip_special_tokens=s,
    clean_up_tokenization_spaces=False)` converts its input to a list and calls
    `tokenizer._tokenizer.decode(ids, skip_special_tokens=s)`; calling that directly
    saves most of a detokenization step's cost. A class that overrides `_decode`
    (or `decode`) keeps the wrapper.
    """
    kind = type(tokenizer)
    plain = _RUST_DECODERS.get(kind)
    if plain is None:
        plain = False
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            plain = (issubclass(kind, TokenizersBackend)
                     and kind._decode is TokenizersBackend._decode
                     and kind.decode is PreTrainedTokenizerBase.decode)
        except ImportError:  # another transformers layout: keep the wrapper
            pass
        _RUST_DECODERS[kind] = plain
    return tokenizer._tokenizer if plain else None


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_string: str | None = None
        # Of the last update's tokens, how many belong to the output (all of them unless
        # a stop string ended it partway).
        self.num_tokens_kept = 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character: it would misalign the window
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @classmethod
    def from_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def _decode(self, token_ids: Sequence[int]) -> str:
        backend = _rust_decoder(self.tokenizer)
        if backend is not None:  # the same call, without transformers' Python wrapper
            return backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def update(self, new_token_ids: Sequence[int], stop_token_terminated: bool = False) -> str | None:
        """Add tokens; return the stop string that matched, or None.

        `stop_token_terminated`: the last token is EOS or a stop token id; its text is
        left out unless `include_stop_str_in_output`.
        """
        if self.stop_string is not None:
            self.num_tokens_kept = 0
            return self.stop_string  # already stopped: later tokens are discarded
        token_ids = list(new_token_ids)
        self.num_tokens_kept = len(token_ids)
        if stop_token_terminated and token_ids and not self.include_stop_str_in_output:
            token_ids = token_ids[:-1]
        if not self.stop:
            self.num_output_tokens += self.num_tokens_kept
            for token_id in token_ids:
                self.output_text += self._next_text(token_id)
            return None
        # Stop strings are checked after every token: with speculative decoding one
        # update carries several, and the tokens after the one that completes a stop
        # string are not part of the output (`num_tokens_kept` says how many are).
        for index, token_id in enumerate(token_ids):
            previous_len = len(self.output_text)
            self.output_text += self._next_text(token_id)
            self.num_output_tokens += 1
            if self.num_output_tokens > self.min_tokens:
                self._check_stop_strings(previous_len)
                if self.stop_string is not None:
                    self.num_tokens_kept = index + 1
                    return self.stop_string
        self.num_output_tokens += self.num_tokens_kept - len(token_ids)  # the stop token
        return None

    def _next_text(self, token_id: int) -> str:
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        pending = len(self._tokens) - self._read_offset
        if not full_text.endswith(_REPLACEMENT) or pending >= _MAX_PENDING_TOKENS:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return full_text[len(prefix_text):]
        return ""

    def _check_stop_strings(self, previous_len: int) -> None:
        # A match must end in the new text (else it was found before), so it starts at
        # or after previous_len - max_stop_len + 1.
        start = max(0, previous_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.stop_string = stop

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        if self.include_stop_str_in_output:
            return 0  # a stop string would be shown anyway; text after it is cut later
        text = self.output_text
        held = 0
        for stop in self.stop:
            tail = text[-(len(stop) - 1):] if len(stop) > 1 else ""
            if stop[0] not in tail:
                continue  # no suffix of the text can begin this stop string
            for length in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:length]):
                    held = length
                    break
        return held

    def get_text(self, finished: bool = False) -> str:
        """The text a client may see now (see the module docstring)."""
        if finished and self.stop_string is None:
            self._flush()
        if finished or self.stop_string is not None:
            return self.output_text
        return self.output_text[:len(self.output_text) - self._held_back_len()]

    def _flush(self) -> None:
        """Emit whatever the window still holds (e.g. invalid UTF-8 at the very end)."""
        if self._read_offset < len(self._tokens):
            prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset:])
            self.output_text += full_text[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._tokens)


class TokenTextCache:
    """Text of single tokens, for logprobs (`decode([token_id])`, memoised)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text
