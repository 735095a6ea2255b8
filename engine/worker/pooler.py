"""Pooling: a pooling request's token hidden states -> its vector (engine.pooling_params).

The scheduler computes a pooling request's whole prompt in one step, so its tokens'
hidden states are rows [start, end) of that step's output:

    step tokens (query_start_loc [0, 3, 5, 9]):  a a a | b b | c c c c
    b pools rows 3..4, c rows 5..8; a, a generating request, samples as usual.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.pooling_params import PoolingParams


def pool_rows(model: nn.Module, hidden_states: torch.Tensor, start: int, end: int,
              params: PoolingParams) -> list[float]:
    """The vector of the request whose tokens are rows [start, end) of `hidden_states`,
    as float32 values: mean / first / last row, cut to `dimensions`, L2-normalized if
    asked; for `classify`, the logits of `model`'s classification head on the first row
    (an encoder's [CLS]) or, for a model that `classifies_last_token` (a decoder
    reranker), the last. A request's vector depends only on its own rows."""
    if params.pooling_type == "classify":
        if not hasattr(model, "classify"):
            raise ValueError("this model has no classification head")
        row = end - 1 if getattr(model, "classifies_last_token", False) else start
        return model.classify(hidden_states[row:row + 1])[0].tolist()
    rows = hidden_states[start:end].float()
    if params.pooling_type == "mean":
        # A prompt left out of the pooling (sentence-transformers masks its positions;
        # an input that is all prompt pools to zeros there, here to its last row).
        vector = rows[min(params.prompt_tokens, len(rows) - 1):].mean(dim=0)
    elif params.pooling_type == "cls":
        vector = rows[0]
    else:  # "last"
        vector = rows[-1]
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
