"""Per-request pooling parameters: a request that wants a vector, not tokens.

A pooling request (embeddings) is prefill only: the scheduler computes its whole prompt
in one step, the runner pools that step's hidden states of its tokens into one vector
instead of sampling, and the request finishes there, its blocks freed at once.

    hidden states of a 4-token request   h0 h1 h2 h3
      mean  -> (h0 + h1 + h2 + h3) / 4   (sentence-transformers' default)
      cls   -> h0                        (BERT's [CLS] token; bge)
      last  -> h3                        (decoder embedders: Qwen3-Embedding)
    then the first `dimensions` values (Matryoshka models), then L2-normalized if asked.
      classify -> the model's classification head on h0 (a cross-encoder reranker: BERT
                  or XLM-RoBERTa for sequence classification) or on h3 (a decoder
                  reranker, Qwen3ForSequenceClassification): its raw logits, one per label

A cross-encoder reads a (query, document) pair as one prompt: BERT's [CLS] q [SEP] d [SEP],
its tokens from `token_type_start` on (the document's) token type 1, the others 0;
XLM-RoBERTa's <s> q </s></s> d </s> and a decoder's q + d, one token type.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("mean", "cls", "last", "classify")


class PoolingParamsError(ValueError):
    """An invalid pooling parameter; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class PoolingParams:
    """How one request's token hidden states become its vector."""

    pooling_type: str = "mean"  # one of POOLING_TYPES
    normalize: bool = True
    dimensions: int | None = None  # keep the first N values (before normalizing); None: all
    token_type_start: int | None = None  # a pair's second segment starts here (token type 1)
    # Mean pooling leaves out the first N tokens: a sentence-transformers prompt the model's
    # Pooling excludes (include_prompt false), with the [CLS] before it.
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise PoolingParamsError(f"pooling type {self.pooling_type!r} is not one of "
                                     f"{', '.join(POOLING_TYPES)}", "pooling_type")
        if self.dimensions is not None and self.dimensions < 1:
            raise PoolingParamsError(f"dimensions must be at least 1, got {self.dimensions}",
                                     "dimensions")
