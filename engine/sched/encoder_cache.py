"""The scheduler's view of the encoder cache: which images' encoder outputs the runner
holds, who needs them, and what room is left (vLLM V1's EncoderCacheManager).

The runner keeps `identifier -> embeddings` (engine/worker/model_runner.py); this
mirror decides, so the two never disagree: an image is encoded in the step that first
needs it (`allocate`), serves every later chunk of that prompt and every other request
with the same image while any of them still needs it (`add_user`), then becomes
*freeable*: kept, and revived by a later request with the same image, until its room is
needed (`make_room` evicts freeable entries oldest first and reports them once through
`take_evicted`, so the runner drops them).

Room is counted in embedding rows (one per soft token). An image larger than the whole
cache may still run when nothing else is held (it must run some time); the cache then
holds it alone.

    request A needs image x (12 rows), capacity 16:
      allocate(x, A)   used 12   users {x: {A}}
      add_user(x, B)   B's prompt has x too: no encoding
      release(x, A); release(x, B)  -> x freeable (still held, used 12)
      make_room(8)     evicts x: used 0; take_evicted() -> [x]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.multimodal.inputs import ImageFeature

if TYPE_CHECKING:
    from engine.request import Request


class EncoderCacheManager:
    def __init__(self, capacity: int):
        self.capacity = capacity  # embedding rows
        self.num_used = 0
        self._users: dict[str, set[str]] = {}  # identifier -> req_ids that need it
        self._freeable: OrderedDict[str, None] = OrderedDict()  # no users, oldest first
        self._size: dict[str, int] = {}  # identifier -> rows, for every held entry
        self._evicted: list[str] = []
        self.ever_used = False  # some image was ever held (the x-ray shows the cache then)

    def holds(self, identifier: str) -> bool:
        return identifier in self._size

    def is_user(self, identifier: str, req_id: str) -> bool:
        return req_id in self._users.get(identifier, ())

    def add_user(self, identifier: str, req_id: str) -> None:
        """`req_id` needs the held entry `identifier` (revived if it was freeable)."""
        self._freeable.pop(identifier, None)
        self._users.setdefault(identifier, set()).add(req_id)

    def make_room(self, num_rows: int, keep: Iterable[str] = ()) -> bool:
        """Evict freeable entries (oldest first, never those in `keep`) until `num_rows`
        more fit; True if they do, or if nothing at all is held (an oversized image then
        runs alone)."""
        keep = set(keep)
        for identifier in list(self._freeable):
            if self.num_used + num_rows <= self.capacity:
                break
            if identifier in keep:
                continue
            del self._freeable[identifier]
            self.num_used -= self._size.pop(identifier)
            self._evicted.append(identifier)
        return self.num_used + num_rows <= self.capacity or self.num_used == 0

    def allocate(self, identifier: str, num_rows: int, req_id: str) -> None:
        """Hold a new entry (the runner encodes it this step) for `req_id`; call
        `make_room` first."""
        self._size[identifier] = num_rows
        self.num_used += num_rows
        self.ever_used = True
        self._users[identifier] = {req_id}

    def release(self, identifier: str, req_id: str) -> None:
        """`req_id` no longer needs `identifier`; with no users left it becomes freeable."""
        users = self._users.get(identifier)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        if not users:
            del self._users[identifier]
            self._freeable[identifier] = None

    def take_evicted(self) -> list[str]:
        """Entries evicted since the last call: the runner drops their embeddings."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def reset(self) -> None:
        """Forget everything (the runner is told through `take_evicted`)."""
        self._evicted.extend(self._size)
        self._size.clear()
        self._users.clear()
        self._freeable.clear()
        self.num_used = 0

    @property
    def num_entries(self) -> int:
        return len(self._size)

    @property
    def num_in_use(self) -> int:
        """Entries some request still needs."""
        return len(self._users)


@dataclass
class EncoderPlan:
    """A request's encoder work for one step (see `plan_encoder_inputs`)."""

    num_new_tokens: int  # the request's tokens this step, cut before an image that must wait
    to_encode: list[ImageFeature] = field(default_factory=list)  # images encoded this step
    held: list[str] = field(default_factory=list)  # identifiers it reads from the cache


def plan_encoder_inputs(cache: EncoderCacheManager, request: Request, start: int,
                        num_new_tokens: int, budget_left: int,
                        budget_untouched: bool) -> EncoderPlan:
    """Which of `request`'s images its tokens [start, start + num_new_tokens) need encoded.

    An image is needed when those tokens
    overlap its placeholder run and the cache does not hold it (nor does an earlier image
    of this plan: the same picture twice). It is encoded this step if its rows fit the
    step's encoder budget and the cache (the first image of a step always fits the
    budget, so an image larger than it still runs); otherwise the request computes only
    the tokens before it, which may be none (then it waits for a later step).

    A bidirectional image (Gemma 3) is never split: a chunk that would end inside its
    soft tokens stops before them.

    Worked example (start 10, 30 new tokens, budget 16 rows): images x at 12..21
    (8 rows), y at 25..34 (12 rows) -> x encoded (budget 8 left), y does not fit ->
    num_new_tokens 25 - 10 = 15: the step computes 10..24, y waits.
    """
    plan = EncoderPlan(num_new_tokens)
    planned: set[str] = set()
    rows = 0
    for feature in request.mm_features:
        if feature.offset >= start + plan.num_new_tokens:
            break
        if feature.end <= start:
            continue  # its KV is computed (an earlier chunk, or a prefix-cache hit)
        if feature.bidirectional:
            # Its soft tokens see each other: they are computed in one step. A chunk that
            # would end among them stops before them (or, if it starts among them after a
            # prefix-cache hit, waits for a step with room for the rest).
            first, end = feature.embed_span()
            if first < start + plan.num_new_tokens < end:
                plan.num_new_tokens = max(0, first - start)
                if plan.num_new_tokens == 0:
                    break
        identifier = feature.identifier
        if cache.holds(identifier):
            plan.held.append(identifier)
            continue
        if identifier in planned:
            continue
        num_rows = feature.num_embeds
        fits_budget = rows + num_rows <= budget_left or (budget_untouched and rows == 0)
        if not (fits_budget and cache.make_room(rows + num_rows, plan.held)):
            plan.num_new_tokens = max(0, feature.offset - start)
            break
        plan.to_encode.append(feature)
        planned.add(identifier)
        rows += num_rows
    return plan


def commit_encoder_plan(cache: EncoderCacheManager, plan: EncoderPlan, req_id: str
                        ) -> tuple[int, int]:
    """Hold the plan's images for `req_id` (the request got its tokens); returns the rows
    it encodes and its cache hits (held images it reads for the first time)."""
    hits = 0
    for identifier in plan.held:
        hits += not cache.is_user(identifier, req_id)
        cache.add_user(identifier, req_id)
    for feature in plan.to_encode:
        cache.allocate(feature.identifier, feature.num_embeds, req_id)
    return sum(f.num_embeds for f in plan.to_encode), hits


def release_computed_images(cache: EncoderCacheManager, request: Request,
                            everything: bool = False) -> None:
    """Release the images whose placeholder runs `request` has computed (all of them,
    with `everything`: it finished or was preempted)."""
    for feature in request.mm_features:
        if everything or feature.end <= request.num_computed_tokens:
            cache.release(feature.identifier, request.req_id)
