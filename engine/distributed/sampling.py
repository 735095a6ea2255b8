"""Every rank samples; rank 0's tokens are the ones every rank keeps.

Each rank runs the whole sampler over the same gathered logits, so its persistent
batch appends the same tokens without another message from the engine core. The
same bits in and the same seeds would already give the same tokens; broadcasting
rank 0's choice (a few int64s per step) makes that a guarantee rather than an
assumption about thread counts and reduction order.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import get_tp_group


class FirstRankSampler:
    """Wraps a Sampler: same call, same output, sampled_token_ids taken from rank 0."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, metadata):
        output = self.sampler(logits, metadata)
        output.sampled_token_ids = get_tp_group().broadcast_from_first(
            output.sampled_token_ids.contiguous())
        return output

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)
