"""What the scheduler hands the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """A request the runner has not seen before: everything it needs, in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens with KV already in the blocks (prefix-cache hits)
    eos_token_id: int | None = None
    # KV-cache groups 1.. (a model mixing sliding-window and full attention:
    # engine.kv_cache.groups): their block ids; `block_ids` are group 0's.
    extra_group_block_ids: list[list[int]] = field(default_factory=list)
    # A pooling request: the runner pools its prompt's hidden states instead of sampling.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs under (None: the base model).
    lora_request: LoRARequest | None = None
    # Its images (placeholder runs; the runner reads their rows from its encoder cache).
    mm_features: list[ImageFeature] | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as a diff since their last step.

    Parallel lists, one entry per request. For a request resumed from preemption
    `new_block_ids` is its complete block list (it replaces the old one) and its
    `num_computed_tokens` restarts from its prefix-cache hit.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Several KV-cache groups only: per request, groups 1..'s new (resumed: all) block
    # ids, as `new_block_ids` is group 0's; empty for a one-group model.
    extra_new_block_ids: list[list[list[int]]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class GrammarBitmask:
    """Next-token masks of this step's constrained requests that sample.

    `bitmask` is int32 [rows, ceil(vocab / 32)]: token t is allowed in a row when bit
    t % 32 of `bitmask[row, t // 32]` is set. Without drafts (`num_rows` None) row i is
    the mask of `req_ids[i]`. With drafts, `req_ids[i]` has `num_rows[i]` consecutive
    rows, one per logits row it verifies (1 + its drafts): its row j is the mask after
    its drafts d_0..d_{j-1}.

    Worked example: req_ids [a, b], num_rows [3, 1] (a verifies drafts [5, 6]):
      bitmask rows  0: a's mask   1: a's after 5   2: a's after 5, 6   3: b's mask
    """

    req_ids: list[str]
    bitmask: torch.Tensor
    num_rows: list[int] | None = None  # None: one row per request


@dataclass
class SchedulerOutput:
    """One step's plan. `num_scheduled_tokens` is keyed by req_id, in batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests preempted in this step: the runner drops their rows, keeps their state.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished (or aborted) since the last step: the runner forgets them.
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: masks for the constrained requests that sample this step.
    grammar: GrammarBitmask | None = None
    # Speculative decoding: req_id -> the draft tokens it verifies this step (they are
    # the last len(drafts) of its num_scheduled_tokens). Empty when nobody speculates.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> its block count after a rollback of rejected drafts freed its tail
    # blocks (since its last step): the runner cuts its block list there before
    # appending new_block_ids.
    num_blocks_after_rollback: dict[str, int] = field(default_factory=dict)
    # Images the runner encodes this step, before the forward (each once; it keeps their
    # embeddings by identifier), and identifiers whose embeddings it may drop.
    scheduled_encoder_inputs: list[ImageFeature] = field(default_factory=list)
    free_encoder_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def num_computed_tokens_before(self) -> dict[str, int]:
        """req_id -> its computed tokens when this step was scheduled (before it ran)."""
        cached = self.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        before.update((new.req_id, new.num_computed_tokens) for new in self.scheduled_new_reqs)
        return before
