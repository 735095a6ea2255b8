"""Persistent per-row sampling state: parameters, token counts and generators.

A row is a slot in `[0, max_num_reqs)` that the model runner gives a request for
as long as it is in the batch. Scalar parameters live in numpy arrays indexed by
row, so `make_metadata(row_indices)` is a handful of fancy-indexing gathers; the
rare per-row features (logit bias, min_tokens masking, seeded generators) loop
in Python over only the rows of the batch that use them.

Penalty bookkeeping is kept on the device in a slot pool sized to the rows that
actually have a penalty (not `max_num_reqs x vocab`): `output_counts[slot, t]` is
the number of times token t was output, `prompt_mask[slot, t]` whether it is in
the prompt. Tokens appended between steps are applied in one scatter-add at the
next `make_metadata`.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sample.metadata import SamplingMetadata
from engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 64) - 1


class SamplingState:
    """Sampling parameters and history of every request row.

    Contract with the caller (the model runner):
      * `add_request` before a row first appears in `make_metadata`; the row must
        be free. `output_token_ids` are tokens already generated (a request
        resumed after preemption); they count for penalties and min_tokens.
      * `append_output_token` exactly once per token the sampler produced for the
        row, before the next `make_metadata`.
      * `remove_request` when the row leaves the batch (finished or preempted).
      * All token ids are in `[0, vocab_size)`; logits passed to the sampler have
        `vocab_size` columns.

    Seeded rows own a `torch.Generator` seeded with `params.seed`. Each sampled
    token of a random (non-greedy) seeded row draws exactly one `vocab_size` row
    of uniforms from it, so the row's tokens depend only on its seed and logits,
    never on the rest of the batch. Generators of different rows are independent
    (n > 1 samples need distinct seeds; the frontend derives them).
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str = "cpu"):
        if max_num_reqs < 1 or vocab_size < 1:
            raise ValueError("max_num_reqs and vocab_size must be positive")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        n = max_num_reqs
        self._active = np.zeros(n, dtype=bool)
        self._greedy = np.zeros(n, dtype=bool)
        self._temperature = np.ones(n, dtype=np.float32)
        self._top_k = np.zeros(n, dtype=np.int64)  # 0: disabled
        self._top_p = np.ones(n, dtype=np.float32)  # 1: disabled
        self._min_p = np.zeros(n, dtype=np.float32)  # 0: disabled
        self._repetition = np.ones(n, dtype=np.float32)
        self._frequency = np.zeros(n, dtype=np.float32)
        self._presence = np.zeros(n, dtype=np.float32)
        self._min_tokens = np.zeros(n, dtype=np.int64)
        # Outputs so far; exact for the rows that read it (min_tokens masking), counted
        # only while such a row or a penalised one is in the state (`_num_counting`).
        self._num_output = np.zeros(n, dtype=np.int64)
        self._counts_outputs = np.zeros(n, dtype=bool)
        self._num_counting = 0
        self._num_logprobs = np.full(n, -1, dtype=np.int64)
        self._seeded = np.zeros(n, dtype=bool)  # random row with its own generator
        self._has_bias = np.zeros(n, dtype=bool)
        # Greedy with nothing to apply (no penalty, logit bias, min_tokens masking or
        # logprobs): a batch of only such rows needs no per-row gather.
        self._plain_greedy = np.zeros(n, dtype=bool)
        self._generators: list[torch.Generator | None] = [None] * n
        self._bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n
        self._min_tokens_ids: list[np.ndarray | None] = [None] * n  # EOS + stop ids
        # Penalty slot pool (grown on demand, at most max_num_reqs slots).
        self._pen_slot = np.full(n, -1, dtype=np.int64)
        self._free_slots: list[int] = []
        self._pen_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)
        self._pen_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self._pending_slots: list[np.ndarray] = []
        self._pending_tokens: list[np.ndarray] = []

    # ------------------------------------------------------------------ rows
    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_id: int | None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Put a request in free `row`.

        `generator`: a seeded row's generator returned by an earlier
        `remove_request` (preemption); when omitted, a seeded row gets a fresh
        generator from `params.seed`, advanced past the `len(output_token_ids)`
        draws already made, so a resumed request continues its sequence exactly.
        Raises ValueError for a busy row or a logit_bias token outside the vocab.
        """
        if self._active[row]:
            raise ValueError(f"row {row} is already in use")
        vocab = self.vocab_size
        greedy = params.greedy
        bias = None
        if params.logit_bias:
            ids = np.fromiter((int(t) for t in params.logit_bias), np.int64, len(params.logit_bias))
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"logit_bias token id outside [0, {vocab})")
            values = np.fromiter(params.logit_bias.values(), np.float32, len(ids))
            bias = (ids, values)

        self._active[row] = True
        self._greedy[row] = greedy
        # Filters are neutral on greedy rows, so batch flags only see random rows.
        self._temperature[row] = 1.0 if greedy else params.temperature
        top_k = params.top_k if params.top_k and params.top_k > 0 else 0
        self._top_k[row] = 0 if greedy or top_k >= vocab else top_k
        self._top_p[row] = 1.0 if greedy else params.top_p
        self._min_p[row] = 0.0 if greedy else params.min_p
        self._repetition[row] = params.repetition_penalty
        self._frequency[row] = params.frequency_penalty
        self._presence[row] = params.presence_penalty
        self._num_output[row] = len(output_token_ids)
        self._min_tokens[row] = params.min_tokens
        self._num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._bias[row] = bias
        self._has_bias[row] = bias is not None

        stop_ids = list(params.stop_token_ids)
        if eos_token_id is not None:
            stop_ids.append(eos_token_id)
        stop = np.unique(np.asarray(stop_ids, dtype=np.int64))
        stop = stop[(stop >= 0) & (stop < vocab)]
        self._min_tokens_ids[row] = stop if params.min_tokens > 0 and stop.size else None

        self._generators[row] = None
        self._seeded[row] = False
        if params.seed is not None and not greedy:
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed & _SEED_MASK)
                if output_token_ids:
                    scratch = torch.empty(vocab, dtype=torch.float32, device=self.device)
                    for _ in range(len(output_token_ids)):
                        scratch.uniform_(generator=generator)
            self._generators[row] = generator
            self._seeded[row] = True

        has_penalty = (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )
        counts_outputs = has_penalty or self._min_tokens_ids[row] is not None
        self._counts_outputs[row] = counts_outputs
        self._num_counting += counts_outputs
        self._plain_greedy[row] = (greedy and not has_penalty and bias is None
                                   and self._min_tokens_ids[row] is None
                                   and params.logprobs is None)
        if has_penalty:
            slot = self._alloc_slot()
            self._pen_slot[row] = slot
            if output_token_ids:
                out = torch.as_tensor(output_token_ids, dtype=torch.long)
                counts = torch.bincount(out, minlength=vocab)[:vocab]
                self._pen_counts[slot] = counts.to(self.device, torch.int32)
            if params.repetition_penalty != 1.0 and prompt_token_ids:
                ids = torch.as_tensor(prompt_token_ids, dtype=torch.long, device=self.device)
                self._pen_prompt[slot, ids] = True

    def remove_request(self, row: int) -> torch.Generator | None:
        """Free `row`. Returns its generator (None if unseeded) for a later resume."""
        if not self._active[row]:
            return None
        generator = self._generators[row]
        self._active[row] = False
        self._plain_greedy[row] = False
        self._num_counting -= bool(self._counts_outputs[row])
        self._counts_outputs[row] = False
        self._generators[row] = None
        self._seeded[row] = False
        self._bias[row] = None
        self._has_bias[row] = False
        self._min_tokens_ids[row] = None
        slot = int(self._pen_slot[row])
        if slot >= 0:
            self._pen_slot[row] = -1
            self._free_slots.append(slot)
        return generator

    def append_output_token(self, row: int, token_id: int) -> None:
        """Record one token sampled for `row` (for min_tokens and penalties); nothing to
        do while no row has either."""
        if not self._num_counting:
            return
        self._num_output[row] += 1
        slot = self._pen_slot[row]
        if slot >= 0:
            self._pending_slots.append(np.array([slot], np.int64))
            self._pending_tokens.append(np.array([token_id], np.int64))

    def append_output_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Vectorised `append_output_token`: token `token_ids[i]` for row `rows[i]`; a
        row may repeat (a request that emitted several tokens in one step)."""
        if not self._num_counting:
            return
        rows = np.asarray(rows, dtype=np.int64)
        token_ids = np.asarray(token_ids, dtype=np.int64)
        np.add.at(self._num_output, rows, 1)
        slots = self._pen_slot[rows]
        keep = slots >= 0
        if keep.any():
            self._pending_slots.append(slots[keep])
            self._pending_tokens.append(token_ids[keep])

    @property
    def num_active(self) -> int:
        return int(self._active.sum())

    # ------------------------------------------------------------------ metadata
    def make_metadata(self, row_indices: np.ndarray, offsets: np.ndarray | None = None,
                      draft_token_ids: np.ndarray | None = None) -> SamplingMetadata:
        """Gather the rows of one step, in batch order, into a `SamplingMetadata`.

        A step with drafts has 1 + k rows per request (`row_indices` repeats its row):
        `offsets[i]` is row i's place among them and `draft_token_ids[i]` the draft row i
        checks, so row i comes after the request's tokens plus the drafts of rows
        i - offsets[i] .. i - 1. Those drafts count as outputs of row i, for min_tokens
        and the penalties, as they would if they had been sampled one at a time.

        A batch of plain greedy rows (the common greedy step) gets its metadata without
        the per-feature gathers; it equals `_gather_metadata`'s for those rows.
        """
        rows = np.asarray(row_indices, dtype=np.int64)
        if rows.ndim != 1:
            raise ValueError("row_indices must be one-dimensional")
        num_reqs = len(rows)
        if num_reqs and self._plain_greedy[rows].all():  # implies every row is active
            return SamplingMetadata(
                num_reqs=num_reqs, vocab_size=self.vocab_size, all_greedy=True,
                all_random=False, num_logprobs=np.full(num_reqs, -1, np.int64))
        return self._gather_metadata(rows, offsets, draft_token_ids)

    def _gather_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None,
                         draft_token_ids: np.ndarray | None = None) -> SamplingMetadata:
        """`make_metadata` for any batch: each stage's tensors gathered for the rows
        that use it."""
        if not self._active[rows].all():
            raise ValueError("make_metadata was given a row with no request")
        num_reqs = len(rows)
        vocab = self.vocab_size
        dev = self.device

        def to_dev(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(dev)

        greedy = self._greedy[rows]
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        md = SamplingMetadata(
            num_reqs=num_reqs, vocab_size=vocab, all_greedy=all_greedy, all_random=all_random
        )
        if not all_greedy and not all_random:
            md.is_greedy = to_dev(greedy)
            md.greedy_rows = np.flatnonzero(greedy)

        if not all_greedy:
            temperature = self._temperature[rows]
            if (temperature != 1.0).any():
                md.temperature = to_dev(temperature)
            top_k = self._top_k[rows]
            if top_k.any():
                md.max_top_k = int(top_k.max())
                md.top_k = to_dev(np.where(top_k > 0, top_k, vocab))
            top_p = self._top_p[rows]
            p_on = top_p < 1.0
            if p_on.any():
                md.top_p = to_dev(np.where(p_on, top_p, np.float32(np.inf)))
                md.top_p_unbounded = bool((p_on & (top_k == 0)).any())
            min_p = self._min_p[rows]
            if min_p.any():
                md.min_p = to_dev(min_p)
            for pos in np.flatnonzero(self._seeded[rows]).tolist():
                md.generators[pos] = self._generators[rows[pos]]

        slots = self._pen_slot[rows]
        pen_pos = np.flatnonzero(slots >= 0)
        if pen_pos.size:
            self._flush_pending()
            pen_rows = rows[pen_pos]
            pen_slots = to_dev(slots[pen_pos])
            md.penalty_rows = to_dev(pen_pos)
            md.output_counts = self._pen_counts[pen_slots]  # a copy: ours to change
            if offsets is not None:
                _count_preceding_drafts(md.output_counts, pen_pos, offsets, draft_token_ids)
            repetition = self._repetition[pen_rows]
            md.repetition_penalty = to_dev(repetition)
            md.frequency_penalty = to_dev(self._frequency[pen_rows])
            md.presence_penalty = to_dev(self._presence[pen_rows])
            if (repetition != 1.0).any():
                md.prompt_mask = self._pen_prompt[pen_slots]

        bias_pos = np.flatnonzero(self._has_bias[rows])
        if bias_pos.size:
            parts = [self._bias[rows[p]] for p in bias_pos.tolist()]
            lengths = [len(ids) for ids, _ in parts]
            md.bias_rows = to_dev(np.repeat(bias_pos, lengths))
            md.bias_token_ids = to_dev(np.concatenate([ids for ids, _ in parts]))
            md.bias_values = to_dev(np.concatenate([vals for _, vals in parts]))

        num_output = self._num_output[rows] + (0 if offsets is None else offsets)
        need_min = np.flatnonzero(num_output < self._min_tokens[rows])
        if need_min.size:
            positions, token_ids = [], []
            for pos in need_min.tolist():
                stop = self._min_tokens_ids[rows[pos]]
                if stop is not None:
                    positions.append(np.full(len(stop), pos, np.int64))
                    token_ids.append(stop)
            if positions:
                md.min_tokens_rows = to_dev(np.concatenate(positions))
                md.min_tokens_token_ids = to_dev(np.concatenate(token_ids))

        num_logprobs = self._num_logprobs[rows]
        md.num_logprobs = num_logprobs
        if num_logprobs.size and num_logprobs.max() >= 0:
            md.max_num_logprobs = int(num_logprobs.max())
        return md

    # ------------------------------------------------------------------ penalty pool
    def _alloc_slot(self) -> int:
        self._flush_pending()  # pending counts may target a slot about to be reused
        if not self._free_slots:
            old = self._pen_counts.shape[0]
            new = min(self.max_num_reqs, max(4, 2 * old))
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old] = self._pen_counts
            prompt[:old] = self._pen_prompt
            self._pen_counts, self._pen_prompt = counts, prompt
            self._free_slots.extend(range(new - 1, old - 1, -1))
        slot = self._free_slots.pop()
        self._pen_counts[slot].zero_()
        self._pen_prompt[slot].zero_()
        return slot

    def _flush_pending(self) -> None:
        if not self._pending_slots:
            return
        slots = np.concatenate(self._pending_slots)
        tokens = np.concatenate(self._pending_tokens)
        self._pending_slots.clear()
        self._pending_tokens.clear()
        flat = torch.from_numpy(slots * self.vocab_size + tokens).to(self.device)
        ones = torch.ones(flat.shape[0], dtype=torch.int32, device=self.device)
        self._pen_counts.view(-1).index_add_(0, flat, ones)


def _count_preceding_drafts(counts: torch.Tensor, positions: np.ndarray, offsets: np.ndarray,
                            draft_token_ids: np.ndarray) -> None:
    """Add to counts[j] (the output counts of row positions[j]) the drafts before that
    row in its request. Worked example: a request's rows 4, 5, 6 check drafts [7, 9, -1]
    (offsets 0, 1, 2): row 4 keeps its counts, row 5 gets one more 7, row 6 one more 7
    and one more 9."""
    for j, pos in enumerate(positions.tolist()):
        before = int(offsets[pos])
        if before:
            ids = torch.from_numpy(np.asarray(draft_token_ids[pos - before:pos], np.int64))
            ids = ids.to(counts.device)
            counts[j].index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
