"""The grammar library behind structured outputs: xgrammar, wrapped.

Why xgrammar (0.2.8) rather than llguidance (1.9.1): filling a row's next-token bitmask
costs an order of magnitude less with xgrammar on SmolLM2's vocabulary, and llguidance's
per-step cost grows faster with the batch, though it installs smaller (the figures:
docs/performance.md, "Figures behind choices in the code"). xgrammar's native calls
release the GIL, so compiles run beside the step loop.

`build_grammar` is tokenizer-free; `GrammarBackend`
compiles for one tokenizer and makes per-request matchers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.structured_output.params import StructuredOutputsParams

# JSON is compact and fixed in layout (", " and ": " separators, no free whitespace):
# a weak model cannot then spend its whole budget on newlines and spaces.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar `Grammar` of `params`; raises (RuntimeError, ValueError) when invalid."""
    import xgrammar as xgr

    kind, spec = params.kind, params.spec
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, **_JSON_OPTIONS)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', **_JSON_OPTIONS)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        # EBNF string literals take JSON's escapes.
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def library_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] [^ ]+:\d+: ", "", text)


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocab size; thread-safe for compiles."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Our own cache (keyed by the spec) sits above; one thread per compile.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                             cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        return self._compiler.compile_grammar(build_grammar(params))

    def matcher(self, compiled, stop_token_ids: list[int] | None):
        """A fresh matcher; `stop_token_ids` (EOS, stop_token_ids) end a complete output."""
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def allocate_bitmask(self, num_rows: int):
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def apply_bitmask(logits, bitmask, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens `bitmask` forbids, on `rows` only.

    `bitmask` is [len(rows), words]: row i is the mask of logits row `rows[i]`.
    """
    import torch
    import xgrammar as xgr

    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        return
    # xgrammar indexes the mask with the logits' row numbers: spread it to full height.
    full = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=bitmask.dtype)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                    indices=rows)
