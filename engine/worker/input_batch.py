"""The persistent input batch: per-request rows that survive across steps.

Each request the runner knows gets a stable row when it starts running and keeps
it until it finishes or is preempted. Rows hold what `_prepare_inputs` needs
without touching Python lists: token ids, the block-table row, and the count of
tokens known. A step's batch is just an array of row indices, in the scheduler's
order.

    rows:        0        1        2        3
    req:        "a"      (free)   "c"      "b"
    step batch (scheduler order b, a, c) -> row_indices = [3, 0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers of a request, also while it is preempted.

    `num_computed_tokens` is the count when the request (re)joined the batch; while it
    has a row, the current count is `InputBatch.num_computed_tokens[row]`.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # KV-cache groups 1.. (sliding-window models): their block ids; `block_ids` group 0's.
    extra_group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # KV-cache groups 1..: one more table each (`set_num_extra_groups`); every group's
        # row of a request has the same length, so `num_blocks` serves them all.
        self.extra_block_tables: list[np.ndarray] = []
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() gives row 0 first

    def add_request(self, state: CachedRequestState) -> int:
        """Give `state` a row and copy its tokens and blocks in. Returns the row."""
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_reqs} requests in the batch")
        row = self._free_rows.pop()
        self.req_id_to_row[state.req_id] = row
        num_prompt = len(state.prompt_token_ids)
        num_tokens = state.num_tokens
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids, state.extra_group_block_ids)
        return row

    def set_num_extra_groups(self, num_extra_groups: int) -> None:
        self.extra_block_tables = [np.zeros_like(self.block_table)
                                   for _ in range(num_extra_groups)]

    def remove_request(self, req_id: str) -> int | None:
        """Release the row of `req_id` (if it has one) and return it."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
        return row

    def append_block_ids(self, row: int, block_ids: list[int],
                         extra_group_block_ids: list[list[int]] | None = None) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        for table, ids in zip(self.extra_block_tables, extra_group_block_ids or (), strict=False):
            table[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(block_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)
