"""The scheduler over several KV-cache groups: what it tells the runner (each group's
block ids, as diffs) rebuilds the manager's lists; preemption and finishing free every
group; the x-ray shows the groups."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core.xray import XrayRecorder, build_snapshot
from engine.kv_cache.groups import KVCacheGroupSpec
from engine.kv_cache.manager import cdiv
from engine.sched import Scheduler
from engine.xray_schema import XrayLimits
from tests.support.scheduler import BLOCK_SIZE, add, assert_all_blocks_free, step

WINDOW = 6
GROUPS = [KVCacheGroupSpec(None, (2,)), KVCacheGroupSpec(WINDOW, (0,)),
          KVCacheGroupSpec(WINDOW, (1,))]


def hybrid_scheduler(num_blocks: int, max_num_batched_tokens: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=256),
                     CacheConfig(block_size=BLOCK_SIZE), num_blocks, kv_cache_groups=GROUPS)


class RunnerMirror:
    """The block tables a model runner builds from the scheduler's diffs."""

    def __init__(self):
        self.tables: dict[str, list[list[int]]] = {}

    def apply(self, output) -> None:
        for req_id in output.finished_req_ids | output.preempted_req_ids:
            self.tables.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(new.block_ids)] + [
                list(ids) for ids in new.extra_group_block_ids]
        cached = output.scheduled_cached_reqs
        for i, (req_id, resumed) in enumerate(zip(cached.req_ids,
                                                  cached.resumed_from_preemption,
                                                  strict=True)):
            extra = cached.extra_new_block_ids[i]
            if resumed:
                self.tables[req_id] = [list(cached.new_block_ids[i])] + [list(x) for x in extra]
            else:
                for table, ids in zip(self.tables[req_id], [cached.new_block_ids[i], *extra],
                                      strict=True):
                    table.extend(ids)


def assert_mirror_matches(scheduler: Scheduler, mirror: RunnerMirror) -> None:
    """Every block a query may read is where the runner's table says (the runner may
    still list blocks a window has left: the kernels never read those)."""
    manager = scheduler.kv_cache_manager
    for req_id, tables in mirror.tables.items():
        if req_id not in scheduler.requests:
            continue  # finished: the runner hears of it with the next step
        actual = [manager.get_block_ids(req_id), *manager.get_extra_group_block_ids(req_id)]
        for group, (mine, theirs) in enumerate(zip(tables, actual, strict=True)):
            assert len(mine) == len(theirs)
            for position, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if b != manager.null_block.block_id:
                    assert a == b, (req_id, group, position)


def test_runner_tables_follow_every_group_through_chunks_decodes_and_preemption():
    scheduler = hybrid_scheduler(num_blocks=30)
    mirror = RunnerMirror()
    for i, length in enumerate((20, 13, 30)):
        add(scheduler, f"r{i}", length, max_tokens=24, ignore_eos=True)
    num_preemptions = 0
    while scheduler.has_unfinished_requests():
        output, outputs = step(scheduler)
        mirror.apply(output)
        num_preemptions += len(output.preempted_req_ids)
        assert_mirror_matches(scheduler, mirror)
        manager = scheduler.kv_cache_manager
        for request in scheduler.running:
            full, *sliding = manager.num_blocks_held(request.req_id)
            assert full == cdiv(request.num_computed_tokens, BLOCK_SIZE)
            # After a step of at most 8 tokens: the window plus that chunk.
            assert all(n <= cdiv(WINDOW - 1 + 8, BLOCK_SIZE) + 1 for n in sliding)
    assert num_preemptions > 0  # 30 blocks do not hold three growing requests
    assert_all_blocks_free(scheduler)


def test_xray_shows_the_groups():
    scheduler = hybrid_scheduler(num_blocks=40)
    add(scheduler, "a", 20, max_tokens=4)
    for _ in range(3):  # prompt chunks 0-7, 8-15, 16-19
        step(scheduler)
    snapshot = build_snapshot(scheduler, XrayRecorder(scheduler), 3, XrayLimits())
    assert snapshot.config.kv_cache_groups == [
        "full: layers 2", "sliding_window=6: layers 0", "sliding_window=6: layers 1"]
    (request,) = snapshot.running
    # The last chunk (positions 16..19) reads keys from 11 on: blocks 2-4 of the 5;
    # blocks 0 and 1 were freed when it was scheduled.
    assert request.num_blocks_by_group == [5, 3, 3]
    assert request.num_blocks == 5
