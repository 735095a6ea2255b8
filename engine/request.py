"""A request as the engine core sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache.block_hash import BlockHash, BlockHasher
from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured-output grammar is compiling
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class EngineCoreRequest:
    """What the frontend hands the engine core: tokenized and validated."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    # A pooling request (embeddings): prefill only, its output a vector (see
    # engine.pooling_params); its sampling_params are unused.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter it runs under (engine/lora/); None: the base model.
    lora_request: LoRARequest | None = None
    # Its images, in prompt order (engine/multimodal/inputs.py); None: text only.
    mm_features: list[ImageFeature] | None = None


class Request:
    """One sequence in the engine core.

    Invariants the scheduler relies on:
      * `all_token_ids == prompt_token_ids + output_token_ids`
      * `num_computed_tokens <= num_tokens + num_output_placeholders`; tokens
        `[0, num_computed_tokens)` have KV in this request's blocks once the steps
        already scheduled have run (placeholders exist only with async scheduling).
      * `block_hashes[i]` is the hash of full block i of `all_token_ids`; it is
        computed once, when that block's last token is appended.
    """

    # Slots: the scheduler reads a dozen of these per request per step; slots keep
    # them in the object itself (no per-instance dict), fewer cache lines to touch.
    __slots__ = (
        "req_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "cache_salt", "status", "stop_reason", "num_prompt_tokens",
        "output_token_ids", "all_token_ids", "num_computed_tokens", "num_output_placeholders",
        "num_cached_tokens", "num_preemptions", "max_tokens", "last_token_time", "grammar",
        "stop_check_token_ids", "_block_hasher", "block_hashes", "_next_full_block_tokens",
        "pooling_params", "lora_request", "first_block_keys", "mm_features",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ):
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        # What the first block's hash covers beside its tokens: the salt and the adapter
        # (KV computed under one adapter is never another's). None: neither.
        keys = tuple(k for k in (cache_salt, lora_request and lora_request.cache_key()) if k)
        self.first_block_keys = keys or None
        self.mm_features = sorted(mm_features, key=lambda f: f.offset) if mm_features else []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps still running, not yet appended
        # (their positions may already be scheduled; see engine/core/core.py).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.max_tokens = sampling_params.max_tokens  # resolved by the engine if None
        self.last_token_time: float | None = None  # time.time() of the latest sampled token
        # Structured outputs: the grammar the scheduler masks and advances (None: free).
        self.grammar: RequestGrammar | None = None

        # The tokens that may end it (EOS unless ignored, stop_token_ids): a filter the
        # scheduler checks before its full stop rules (min_tokens etc.).
        self.stop_check_token_ids = frozenset(sampling_params.stop_token_ids) | (
            {eos_token_id} if eos_token_id is not None and not sampling_params.ignore_eos
            else frozenset())

        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        # num_tokens at which the next full block can be hashed (never, without a hasher).
        self._next_full_block_tokens = block_hasher.block_size if block_hasher else -1
        self._update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, block_hasher: BlockHasher | None
    ) -> Request:
        return cls(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            block_hasher=block_hasher,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) == self._next_full_block_tokens:
            self._update_block_hashes()  # this token completes a block

    def _update_block_hashes(self) -> None:
        hasher = self._block_hasher
        if hasher is None:
            return
        if (len(self.block_hashes) + 1) * hasher.block_size <= self.num_tokens:
            self.block_hashes.extend(
                hasher.new_block_hashes(self.all_token_ids, self.block_hashes,
                                        self.block_extra_keys))
        self._next_full_block_tokens = (len(self.block_hashes) + 1) * hasher.block_size

    def block_extra_keys(self, block_index: int) -> tuple | None:
        """What full block `block_index`'s hash covers beside its tokens: the first
        block's salt and adapter, then the identifier of every image whose placeholder
        run touches the block. None: nothing.

        Worked example (block size 4; image "ab12" at positions 6..9, "cd34" at 10..11):
          block 0 (0..3)  -> first_block_keys      block 1 (4..7)  -> ("ab12",)
          block 2 (8..11) -> ("ab12", "cd34")      block 3 (12..15) -> None
        """
        keys = list(self.first_block_keys or ()) if block_index == 0 else []
        if self.mm_features:
            size = self._block_hasher.block_size
            start, end = block_index * size, (block_index + 1) * size
            keys.extend(f.identifier for f in self.mm_features
                        if f.offset < end and f.end > start)
        return tuple(keys) or None

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
