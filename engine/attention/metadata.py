"""Attention metadata: where each step's tokens sit in the batch and in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, read by every attention layer.

    For a step scheduling query lengths [2, 5, 3] of requests whose contexts were
    [0, 7, 20] tokens before the step:

        query_start_loc = [0, 2, 7, 10]     request r's tokens: [qsl[r], qsl[r+1])
        seq_lens        = [2, 12, 23]       context AFTER the step (old + new)
        block_table[r]  = the block ids of request r, padded with 0
        slot_mapping[t] = block_id * block_size + offset of token t (-1: padding)

    Request r's queries are the last `q_len` positions of its sequence; each
    attends causally to every earlier key, all read from the cache.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # Host copies, so backends can plan without a device sync.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    # Images whose tokens attend to each other both ways (Gemma 3): request index ->
    # [(first position, end position)] of each such run among the request's queries. Their
    # keys are the causal ones OR the run's own (a sliding window still applies); the
    # scheduler never splits such a run across steps. None: causal everywhere.
    bidirectional_spans: dict[int, list[tuple[int, int]]] | None = None

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  block_table: np.ndarray, slot_mapping: np.ndarray,
                  device: torch.device) -> AttentionMetadata:
        """From the host arrays (int32 query_start_loc, seq_lens, block_table; int64
        slot_mapping), copied to `device`; the host copies are kept as they are."""
        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return cls(
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=to_device(query_start_loc),
            seq_lens=to_device(seq_lens),
            block_table=to_device(block_table),
            slot_mapping=to_device(slot_mapping),
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_np)

    @cached_property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)

    # Computed once per step (on first use), then shared by every layer.
    @cached_property
    def decode_reqs_np(self) -> np.ndarray:
        """Indices of the requests with a one-token query."""
        return np.flatnonzero(self.query_lens_np == 1)

    @cached_property
    def prefill_reqs_np(self) -> np.ndarray:
        """Indices of the requests with a longer query (a prompt or a prompt chunk)."""
        return np.flatnonzero(self.query_lens_np > 1)
