"""Engine x-ray: what the engine core records for a viewer, and the snapshot it builds.

    EngineCore.add_request() ─▶ XrayRecorder.note_request()    learn each prompt block's parent
    EngineCore.step()        ─▶ XrayRecorder.note_scheduled()  count the prefix-cache hits of
                                                               admitted requests (O(1) each)
                             ─▶ XrayRecorder.record_step()     one tuple into a ring of the
                                                               last STEP_HISTORY steps
    XrayCall over the IPC    ─▶ build_snapshot()               between two steps, on demand,
                                                               bounded by XrayLimits

Nothing here formats data while serving: the step loop only appends a tuple and, for a
newly admitted request, bumps one counter. The snapshot is built only when a viewer asks
(the frontend caches it and asks a few times a second at most) and its size is bounded
for any pool: requests and block ids are capped, the block map is run-length encoded over
at most `max_map_cells` cells, the prefix tree keeps the `max_tree_nodes` nodes with the
biggest subtrees. It holds token counts, block ids and hashes, never token ids or text.

The snapshot's structs (the JSON schema of GET /xray/state) are in engine/xray_schema.py.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from engine.kv_cache.block_hash import BlockHash
from engine.request import Request
from engine.xray_schema import (
    HASH_HEX_DIGITS,
    SCHEMA_VERSION,
    XrayBlockMap,
    XrayConfig,
    XrayEncoderCache,
    XrayLimits,
    XrayPrefixTree,
    XrayRequest,
    XraySnapshot,
    XraySteps,
    XrayTreeNode,
)

if TYPE_CHECKING:
    from engine.outputs import SchedulerStats
    from engine.sched.output import SchedulerOutput
    from engine.sched.scheduler import Scheduler

STEP_HISTORY = 400  # steps kept for the timeline
RECENT_CHAINS = 256  # new requests whose block-hash chains the next snapshot learns from

# Block map cell kinds.
FREE, FREE_CACHED, IN_USE = 0, 1, 2
_REF_CNT, _BLOCK_ID = operator.attrgetter("ref_cnt"), operator.attrgetter("block_id")


# --------------------------------------------------------------------------- recorder
class XrayRecorder:
    """What the core remembers between snapshots; every hook is O(1) or runs in C.

    `parents[h]` is the hash of the block before block `h` in its chain (None for a
    prompt's first block), learned from prompts at arrival and, at each snapshot, from the
    chains of live requests and of the last RECENT_CHAINS requests added or generating
    since the last snapshot (a request's `block_hashes` list grows in place as it
    generates, so keeping the list is enough to learn its generated blocks after it
    finished). `hit_ends[h]` counts prefix-cache hits whose deepest block was `h`: a hit
    on a chain covers every ancestor too, so a node's hit count is the sum over its
    subtree. Both are pruned to cached hashes once they outgrow the pool.
    """

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._block_size = scheduler.block_size
        self.steps: deque[tuple] = deque(maxlen=STEP_HISTORY)
        self.parents: dict[BlockHash, BlockHash | None] = {}
        self.hit_ends: dict[BlockHash, int] = {}
        self.recent_chains: deque[list[BlockHash]] = deque(
            maxlen=RECENT_CHAINS + scheduler.config.max_num_seqs)
        self.num_snapshots = 0
        self.prune_at = 2 * scheduler.kv_cache_manager.num_blocks + 1024

    def note_request(self, request: Request) -> None:
        """Learn the parents of a new request's full prompt blocks; keep its chain."""
        self.learn(request.block_hashes)
        self.recent_chains.append(request.block_hashes)
        if len(self.parents) > self.prune_at:
            self.prune()

    def learn(self, hashes: list[BlockHash]) -> None:
        """Learn the parents along one request's chain of block hashes."""
        if hashes:
            self.parents[hashes[0]] = None
            # [h0, h1, h2] -> {h1: h0, h2: h1}
            self.parents.update(zip(itertools.islice(hashes, 1, None), hashes, strict=False))

    def learn_recent(self) -> None:
        """Learn the chains kept since the last snapshot and those of live requests; keep
        the chains of requests that generate (running, or preempted after generating):
        they may finish, with more generated blocks, before the next snapshot."""
        for chain in self.recent_chains:
            self.learn(chain)
        self.recent_chains.clear()
        for request in self._scheduler.requests.values():
            self.learn(request.block_hashes)
            if request.num_output_tokens:
                self.recent_chains.append(request.block_hashes)

    def note_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Count the prefix-cache hits of requests admitted (or resumed) in this step."""
        new_reqs = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        if not new_reqs and True not in cached.resumed_from_preemption:
            return  # the usual decode step
        requests = self._scheduler.requests
        for data in new_reqs:
            self._count_hit(requests[data.req_id], data.num_computed_tokens)
        for req_id, resumed, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.num_computed_tokens,
            strict=True,
        ):
            if resumed:
                self._count_hit(requests[req_id], num_computed)

    def _count_hit(self, request: Request, num_hit_tokens: int) -> None:
        num_hit_blocks = num_hit_tokens // self._block_size
        if num_hit_blocks:
            deepest = request.block_hashes[num_hit_blocks - 1]
            self.hit_ends[deepest] = self.hit_ends.get(deepest, 0) + 1

    def record_step(self, step: int, scheduler_output: SchedulerOutput,
                    stats: SchedulerStats, num_finished: int) -> None:
        """Append one step to the ring (field order of XraySteps)."""
        cached = scheduler_output.scheduled_cached_reqs
        self.steps.append((
            step, time.time(), stats.step_duration_s * 1000.0,
            len(scheduler_output.num_scheduled_tokens), stats.num_prompt_tokens,
            stats.num_scheduled_tokens - stats.num_prompt_tokens,
            len(scheduler_output.scheduled_new_reqs) + cached.resumed_from_preemption.count(True),
            len(scheduler_output.preempted_req_ids), num_finished,
            stats.num_running_reqs, stats.num_waiting_reqs,
            len(scheduler_output.scheduled_encoder_inputs),
        ))

    def prune(self) -> None:
        """Keep only cached hashes (plus live requests' chains); hits on evicted blocks
        move to their nearest cached ancestor, so ancestors keep their counts."""
        cached = self._scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        self.roll_up_hits()
        self.parents = {h: p for h, p in self.parents.items() if h in cached}
        for request in self._scheduler.requests.values():
            self.learn(request.block_hashes)
        self.prune_at = max(self.prune_at, 2 * len(self.parents) + 1024)

    def roll_up_hits(self) -> None:
        cached = self._scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        if all(h in cached for h in self.hit_ends):
            return
        rolled: dict[BlockHash, int] = {}
        for block_hash, count in self.hit_ends.items():
            h: BlockHash | None = block_hash
            while h is not None and h not in cached:
                h = self.parents.get(h)
            if h is not None:
                rolled[h] = rolled.get(h, 0) + count
        self.hit_ends = rolled


# --------------------------------------------------------------------------- snapshot
def build_snapshot(scheduler: Scheduler, recorder: XrayRecorder, num_steps: int,
                   limits: XrayLimits) -> XraySnapshot:
    """The core's state now (call it between two steps). Cost: O(blocks + listed items)."""
    # CPU time, not wall time: on a busy machine the core may wait for a CPU meanwhile,
    # which is not what the snapshot costs (the frontend paces snapshots by this).
    started = time.thread_time()
    now = time.time()
    recorder.num_snapshots += 1
    recorder.learn_recent()
    if len(recorder.parents) > recorder.prune_at:
        recorder.prune()  # rolls the hits up, too
    else:
        recorder.roll_up_hits()
    manager = scheduler.kv_cache_manager
    running: list[XrayRequest] = []
    waiting: list[XrayRequest] = []
    num_block_ids_left = limits.max_block_ids  # shared by every listed request, in order
    for queue, listed in ((scheduler.running, running), (scheduler.waiting, waiting)):
        for request in itertools.islice(queue, limits.max_requests):
            listed.append(_request(request, manager, now, num_block_ids_left,
                                   scheduler.speculator))
            num_block_ids_left -= sum(count for _, count in listed[-1].block_runs)
    config = scheduler.config
    snapshot = XraySnapshot(
        schema_version=SCHEMA_VERSION,
        seq=recorder.num_snapshots,
        taken_at=now,
        build_ms=0.0,
        num_steps=num_steps,
        config=XrayConfig(
            num_blocks=manager.num_blocks, block_size=scheduler.block_size,
            max_model_len=scheduler.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, policy=config.policy,
            enable_prefix_caching=manager.enable_caching,
            kv_cache_groups=[f"{spec.kind}: layers {', '.join(map(str, spec.layer_indices))}"
                             for spec in manager.group_specs]),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        running=running,
        waiting=waiting,
        blocks=_block_map(manager, limits),
        prefix_tree=_prefix_tree(manager, recorder, limits),
        steps=_steps(recorder.steps),
        encoder_cache=_encoder_cache(scheduler.encoder_cache),
    )
    snapshot.build_ms = (time.thread_time() - started) * 1000.0
    return snapshot


def _encoder_cache(cache) -> XrayEncoderCache | None:
    """The encoder cache's occupancy; None while it has never held an image."""
    if cache.num_entries == 0 and not cache.ever_used:
        return None
    return XrayEncoderCache(capacity=cache.capacity, num_used=cache.num_used,
                            num_entries=cache.num_entries, num_in_use=cache.num_in_use)


def _steps(rows: deque[tuple]) -> XraySteps:
    """Rows (one tuple per step, in XraySteps' field order) to columns."""
    if not rows:
        return XraySteps(*([] for _ in XraySteps.__struct_fields__))
    columns = [list(column) for column in zip(*rows, strict=True)]
    columns[1] = [round(t, 3) for t in columns[1]]  # end_time: ms are enough
    columns[2] = [round(ms, 3) for ms in columns[2]]  # duration_ms: µs are enough
    return XraySteps(*columns)


def _request(request: Request, manager, now: float, max_block_ids: int,
             speculator=None) -> XrayRequest:
    blocks = manager.req_to_blocks.get(request.req_id, [])
    listed = blocks[:max(max_block_ids, 0)]
    num_drafted, num_accepted = (speculator.acceptance(request.req_id) if speculator
                                 else (0, 0))
    return XrayRequest(
        req_id=request.req_id,
        status=request.status.name.lower(),
        priority=request.priority,
        num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_output_tokens=request.num_output_tokens,
        max_tokens=request.max_tokens or 0,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_blocks=len(blocks),
        num_preemptions=request.num_preemptions,
        age_s=max(now - request.arrival_time, 0.0),
        block_runs=id_runs([block.block_id for block in listed]),
        num_draft_tokens=num_drafted,
        num_accepted_tokens=num_accepted,
        num_blocks_by_group=(manager.num_blocks_held(request.req_id)
                             if manager.num_groups > 1 else None),
        pooling=request.pooling_params is not None,
        lora_name=request.lora_request.name if request.lora_request is not None else None,
        num_images=len(request.mm_features),
        num_image_tokens=sum(f.num_embeds for f in request.mm_features),
    )


def id_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as (first, count), in order.

    Example: [7, 8, 9, 3, 4, 12] -> [(7, 3), (3, 2), (12, 1)]
    """
    runs: list[tuple[int, int]] = []
    for block_id in ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def _block_map(manager, limits: XrayLimits) -> XrayBlockMap:
    pool = manager.block_pool
    num_blocks = pool.num_blocks
    ref_cnts = np.fromiter(map(_REF_CNT, pool.blocks), dtype=np.int64, count=num_blocks)
    cached = pool.cached_block_hash_to_block
    cached_ids = np.fromiter(map(_BLOCK_ID, cached.values()), dtype=np.int64, count=len(cached))
    kinds = np.zeros(num_blocks, dtype=np.int64)
    kinds[cached_ids] = FREE_CACHED
    in_use = ref_cnts > 0
    kinds[in_use] = IN_USE
    num_in_use = int(in_use.sum())
    num_free_cached = int((kinds == FREE_CACHED).sum())
    cell_size = -(-num_blocks // max(limits.max_map_cells, 1))
    if cell_size > 1:
        # 10 blocks, cell_size 4: pad to 12, reshape to 3 cells of 4, keep each cell's max.
        pad = (-num_blocks) % cell_size
        kinds = np.pad(kinds, (0, pad)).reshape(-1, cell_size).max(axis=1)
        ref_cnts = np.pad(ref_cnts, (0, pad)).reshape(-1, cell_size).max(axis=1)
    return XrayBlockMap(
        num_blocks=num_blocks,
        num_in_use=num_in_use,
        num_free=num_blocks - num_in_use,
        num_free_cached=num_free_cached,
        num_cached=len(cached),
        cell_size=cell_size,
        runs=run_length(kinds, ref_cnts),
        eviction_head=[b.block_id for b in pool.free_block_queue.peek_n(limits.num_eviction_head)],
    )


def run_length(kinds: np.ndarray, ref_cnts: np.ndarray) -> list[tuple[int, int, int]]:
    """(kind, ref_cnt, length) runs of equal neighbours.

    Example: kinds [0, 0, 2, 2, 2, 1], ref_cnts [0, 0, 1, 1, 3, 0]
      changes at 2, 4, 5 -> starts [0, 2, 4, 5] -> lengths [2, 2, 1, 1]
      -> [(0, 0, 2), (2, 1, 2), (2, 3, 1), (1, 0, 1)]
    """
    if len(kinds) == 0:
        return []
    changes = np.flatnonzero((kinds[1:] != kinds[:-1]) | (ref_cnts[1:] != ref_cnts[:-1])) + 1
    starts = np.concatenate(([0], changes))
    lengths = np.diff(np.concatenate((starts, [len(kinds)])))
    return list(zip(kinds[starts].tolist(), ref_cnts[starts].tolist(), lengths.tolist(),
                    strict=True))


# Parent codes of a tree's tops; every other node's parent is its index.
ROOT, DETACHED, UNATTACHED = -1, -2, -3
_MISSING = object()


def _prefix_tree(manager, recorder: XrayRecorder, limits: XrayLimits) -> XrayPrefixTree:
    """The tree of cached blocks, summed with numpy so a 100,000-block cache stays cheap:
    nodes are indexed 0..n-1 in `cached` order, `parent[i]` is a node index or a top code."""
    cached = manager.block_pool.cached_block_hash_to_block
    if manager.num_groups > 1:  # group 0's chains (the others' keys are (hash, group))
        cached = {h: block for h, block in cached.items() if isinstance(h, bytes)}
    hashes = list(cached)
    n = len(hashes)
    # Hash -> node index, plus the top codes: a parent hash of None is a ROOT, one never
    # recorded (_MISSING) UNATTACHED, one not cached (not a key) DETACHED. Maps run in C.
    index: dict[object, int] = dict(zip(hashes, range(n), strict=True))
    index[None], index[_MISSING] = ROOT, UNATTACHED
    parent_hashes = map(recorder.parents.get, hashes, itertools.repeat(_MISSING))
    parent = np.fromiter(map(index.get, parent_hashes, itertools.repeat(DETACHED)),
                         dtype=np.int64, count=n)
    hits = np.zeros(n, dtype=np.int64)
    for block_hash, count in recorder.hit_ends.items():
        if (i := index.get(block_hash, -1)) >= 0:
            hits[i] += count
    totals = _subtree_totals(parent, hits)  # [:, 0] cached blocks, [:, 1] hits
    sizes, hit_sums = totals[:, 0].tolist(), totals[:, 1].tolist()

    # Best first from the roots: a node is listed only after its parent. Children of a
    # node are a slice of the nodes sorted by parent.
    by_parent = np.argsort(parent, kind="stable")
    sorted_parent = parent[by_parent]
    nodes: list[XrayTreeNode] = []
    order = itertools.count()
    heap = [(-sizes[i], next(order), i, -1) for i in np.flatnonzero(parent == ROOT).tolist()]
    heapq.heapify(heap)
    while heap and len(nodes) < limits.max_tree_nodes:
        _, _, i, parent_index = heapq.heappop(heap)
        block_hash = hashes[i]
        block = cached[block_hash]
        nodes.append(XrayTreeNode(
            block_id=block.block_id, hash=block_hash.hex()[:HASH_HEX_DIGITS],
            parent=parent_index, ref_cnt=block.ref_cnt, num_hits=hit_sums[i],
            num_blocks_below=sizes[i]))
        first, last = np.searchsorted(sorted_parent, [i, i + 1])
        for child in by_parent[first:last].tolist():
            heapq.heappush(heap, (-sizes[child], next(order), child, len(nodes) - 1))
    size_array = totals[:, 0]
    return XrayPrefixTree(
        nodes=nodes, num_cached_blocks=n, num_roots=int((parent == ROOT).sum()),
        num_in_tree=int(size_array[parent == ROOT].sum()),
        num_detached=int(size_array[parent == DETACHED].sum()),
        num_unattached=int(size_array[parent == UNATTACHED].sum()))


def _subtree_totals(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per node: [cached blocks in its subtree, sum of `values` over it] (tops: parent < 0).

    Depths by pointer doubling: `up[i]` is an ancestor of i (a top points to itself) and
    `depth[i]` the steps from i to it; each round doubles the jump. Chain 0 <- 1 <- 2 <- 3
    (parent [-1, 0, 1, 2]): up [0, 0, 1, 2], depth [0, 1, 1, 1]
    -> up [0, 0, 0, 1], depth [0, 1, 2, 2] -> up [0, 0, 0, 0], depth [0, 1, 2, 3].
    Then the levels, deepest first, add their totals into their parents.
    """
    n = len(parent)
    totals = np.stack([np.ones(n, dtype=np.int64), values], axis=1)
    if n == 0:
        return totals
    is_top = parent < 0
    up = np.where(is_top, np.arange(n), parent)
    depth = (~is_top).astype(np.int64)
    while True:
        next_up = up[up]
        if np.array_equal(next_up, up):
            break
        depth += depth[up]
        up = next_up
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[by_depth], np.arange(int(depth.max()) + 2))
    for level in range(int(depth.max()), 0, -1):
        members = by_depth[bounds[level]:bounds[level + 1]]
        np.add.at(totals, parent[members], totals[members])
    return totals
