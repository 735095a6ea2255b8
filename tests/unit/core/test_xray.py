"""The engine x-ray snapshot (engine/core/xray.py, engine/xray_schema.py) against exact engine-core states.

An EngineCore over the echo FakeExecutor, 4-token blocks and a tiny pool: every block
id, ref count, tree edge and step row below follows from the scheduler's rules (blocks
are taken from the head of the free queue, a finished request's blocks go back tail
first, the last running request is preempted).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.core import EngineCore
from engine.core.xray import (
    FREE,
    FREE_CACHED,
    IN_USE,
    RECENT_CHAINS,
    STEP_HISTORY,
    id_runs,
    run_length,
)
from engine.ipc import XrayCall, XrayResult, core_codec, frontend_codec
from engine.request import EngineCoreRequest, RequestStatus
from engine.sampling_params import SamplingParams
from engine.xray_schema import (
    SCHEMA_VERSION,
    XrayBlockMap,
    XrayConfig,
    XrayLimits,
    XrayPrefixTree,
    XrayRequest,
    XraySnapshot,
    XraySteps,
    XrayTreeNode,
)
from tests.support.server_fixtures import FakeExecutor

BLOCK_SIZE = 4


def make_core(num_blocks: int, max_num_seqs: int = 8, max_model_len: int = 256) -> EngineCore:
    config = EngineConfig(
        model_config=ModelConfig(model="fake", max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
    )
    return EngineCore(config, FakeExecutor(config, vocab_size=1000, num_blocks=num_blocks))


def add(core: EngineCore, req_id: str, prompt: list[int], max_tokens: int = 100) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineCoreRequest(req_id, prompt, params))


def snap(core: EngineCore, **limits) -> XraySnapshot:
    return core.xray_snapshot(XrayLimits(**limits))


def by_id(snapshot: XraySnapshot) -> dict:
    return {r.req_id: r for r in (*snapshot.running, *snapshot.waiting)}


def tree_edges(snapshot: XraySnapshot) -> list[tuple[int, int | None]]:
    """(block_id, parent block_id or None) per tree node, in node order."""
    nodes = snapshot.prefix_tree.nodes
    return [(n.block_id, nodes[n.parent].block_id if n.parent >= 0 else None) for n in nodes]


PROMPT_A = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens


def test_two_requests_sharing_a_prefix():
    core = make_core(num_blocks=16)
    add(core, "a", PROMPT_A)
    core.step()  # a: 10 prompt tokens in blocks 0, 1, 2 (0 and 1 full, cached)
    add(core, "b", PROMPT_A[:8] + [50, 51, 52])  # shares a's first two blocks
    core.step()  # b hits blocks 0-1 (8 tokens), computes 3 in new block 3; a decodes
    s = snap(core)

    assert (s.schema_version, s.seq, s.num_steps) == (1, 1, 2)
    assert (s.num_running, s.num_waiting, s.waiting) == (2, 0, [])
    a, b = s.running
    assert (a.req_id, a.status, a.num_prompt_tokens, a.num_computed_tokens,
            a.num_output_tokens, a.num_cached_tokens, a.num_blocks, a.block_runs) == (
        "a", "running", 10, 11, 2, 0, 3, [(0, 3)])
    assert (b.req_id, b.num_prompt_tokens, b.num_computed_tokens, b.num_output_tokens,
            b.num_cached_tokens, b.num_blocks, b.block_runs) == (
        "b", 11, 11, 1, 8, 3, [(0, 2), (3, 1)])
    assert a.prompt_text is None and b.output_text is None

    blocks = s.blocks
    # Blocks 0-1 held by both (ref 2), 2-3 by one each, 4-15 free and never used.
    assert blocks.runs == [(IN_USE, 2, 2), (IN_USE, 1, 2), (FREE, 0, 12)]
    assert (blocks.num_blocks, blocks.num_in_use, blocks.num_free, blocks.num_free_cached,
            blocks.num_cached, blocks.cell_size) == (16, 4, 12, 0, 2, 1)
    assert blocks.eviction_head == list(range(4, 16))

    tree = s.prefix_tree
    assert tree_edges(s) == [(0, None), (1, 0)]  # one trunk: the shared prefix
    assert [(n.ref_cnt, n.num_hits, n.num_blocks_below) for n in tree.nodes] == [
        (2, 1, 2), (2, 1, 1)]
    assert (tree.num_cached_blocks, tree.num_roots, tree.num_in_tree, tree.num_detached,
            tree.num_unattached) == (2, 1, 2, 0, 0)
    assert tree.nodes[0].hash == core.scheduler.kv_cache_manager.block_pool.blocks[
        0].block_hash.hex()[:16]

    steps = s.steps
    assert steps.step == [1, 2]
    assert steps.num_reqs == [1, 2]
    assert steps.num_prefill_tokens == [10, 3]  # b's 3 uncached prompt tokens
    assert steps.num_decode_tokens == [0, 1]  # a's first decode
    assert steps.num_admitted == [1, 1]
    assert steps.num_preemptions == [0, 0] and steps.num_finished == [0, 0]
    assert steps.num_running == [1, 2] and steps.num_waiting == [0, 0]

    core.step()  # block 2 (a's tokens 8-11) and block 3 (b's) fill up and are cached
    s = snap(core)
    assert s.seq == 2
    assert tree_edges(s) == [(0, None), (1, 0), (2, 1), (3, 1)]  # the trunk branches
    assert [n.num_blocks_below for n in s.prefix_tree.nodes] == [4, 3, 1, 1]


def test_eviction_and_the_free_queue():
    core = make_core(num_blocks=8)
    add(core, "a", list(range(100, 108)), max_tokens=1)  # two full blocks
    core.step()  # computes and finishes: blocks go back tail first (1, then 0)
    s = snap(core)
    assert (s.num_running, s.num_waiting) == (0, 0)
    assert s.blocks.runs == [(FREE_CACHED, 0, 2), (FREE, 0, 6)]
    assert s.blocks.eviction_head == [2, 3, 4, 5, 6, 7, 1, 0]
    assert (s.blocks.num_in_use, s.blocks.num_free_cached) == (0, 2)
    assert tree_edges(s) == [(0, None), (1, 0)]
    assert [n.ref_cnt for n in s.prefix_tree.nodes] == [0, 0]
    assert s.steps.num_finished == [1]

    add(core, "b", list(range(500, 528)))  # 7 blocks: 2-7 and then block 1, evicted
    core.step()
    s = snap(core)
    (b,) = s.running
    assert b.block_runs == [(2, 6), (1, 1)]
    assert s.blocks.runs == [(FREE_CACHED, 0, 1), (IN_USE, 1, 7)]
    assert s.blocks.eviction_head == [0]  # a's first block is all that is left
    assert s.blocks.num_cached == 8
    # a's second block is gone from the tree; its first block is still a (one-block) root.
    assert sorted(tree_edges(s), key=lambda e: e[0]) == [
        (0, None), (1, 7), (2, None), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6)]
    assert s.prefix_tree.num_roots == 2
    assert tree_edges(s)[0] == (2, None)  # the biggest subtree comes first


def test_preemption():
    core = make_core(num_blocks=6, max_num_seqs=2)
    add(core, "a", list(range(100, 108)))
    add(core, "b", list(range(200, 208)))
    for _ in range(5):
        core.step()  # a: blocks 0, 1, 4; b: 2, 3, 5; each now has 8 + 4 tokens computed
    s = snap(core)
    assert [r.block_runs for r in s.running] == [[(0, 2), (4, 1)], [(2, 2), (5, 1)]]
    assert s.blocks.num_free == 0 and s.blocks.eviction_head == []

    core.step()  # a needs a 4th block: b (the last running) is preempted, a takes block 5
    s = snap(core)
    (a,) = s.running
    (b,) = s.waiting
    assert (a.req_id, a.block_runs) == ("a", [(0, 2), (4, 2)])
    assert (b.req_id, b.status, b.num_preemptions, b.num_computed_tokens, b.num_blocks,
            b.block_runs) == ("b", "preempted", 1, 0, 0, [])
    assert (s.num_running, s.num_waiting) == (1, 1)
    # b's blocks went back tail first (5, 3, 2); a took 5, evicting b's third block.
    assert s.blocks.eviction_head == [3, 2]
    assert s.blocks.runs == [(IN_USE, 1, 2), (FREE_CACHED, 0, 2), (IN_USE, 1, 2)]
    assert sorted(tree_edges(s)) == [(0, None), (1, 0), (2, None), (3, 2), (4, 1)]
    assert s.steps.num_preemptions[-1] == 1 and s.steps.num_admitted[-1] == 0
    assert s.steps.num_running[-1] == 1 and s.steps.num_waiting[-1] == 1
    assert s.steps.num_preemptions[:-1] == [0] * 5


def test_hits_roll_up_when_the_deepest_hit_block_is_evicted():
    core = make_core(num_blocks=32)
    prefix = list(range(100, 112))  # 3 full blocks
    add(core, "a", prefix + [1], max_tokens=1)
    core.step()
    add(core, "b", prefix + [2], max_tokens=1)  # hits all 3 blocks
    add(core, "c", prefix[:8] + [3], max_tokens=1)  # hits the first 2
    core.step()
    s = snap(core)
    assert [(n.block_id, n.num_hits) for n in s.prefix_tree.nodes] == [(0, 2), (1, 2), (2, 1)]
    # Evict block 2 (the deepest block b hit): its hit moves up to block 1.
    pool = core.scheduler.kv_cache_manager.block_pool
    pool.uncache_blocks([pool.blocks[2]])
    s = snap(core)
    assert [(n.block_id, n.num_hits) for n in s.prefix_tree.nodes] == [(0, 2), (1, 2)]
    assert core.xray.hit_ends == {pool.blocks[1].block_hash: 2}


def test_detached_and_unattached_blocks():
    core = make_core(num_blocks=32)
    add(core, "a", list(range(100, 109)))  # blocks 0, 1 cached
    core.step()
    # A failed step discards the KV of its requests' blocks: a's too, where shared.
    add(core, "b", list(range(100, 104)) + [7, 7, 7, 7, 7])  # hits block 0, caches block 3
    core.step()
    core.scheduler.finish_requests(["b"], RequestStatus.FINISHED_ERROR)
    s = snap(core)
    tree = s.prefix_tree
    # Block 0's hash is gone; a's block 1 (child of block 0) can never be hit now.
    assert (tree.num_cached_blocks, tree.num_roots, tree.num_detached, tree.nodes) == (
        1, 0, 1, [])
    # A core that never saw a chain cannot attach its blocks.
    core.xray.parents.clear()
    core.xray.recent_chains.clear()
    core.abort_requests(["a"])
    s = snap(core)
    assert (s.prefix_tree.num_unattached, s.prefix_tree.num_detached) == (1, 0)


def test_generated_blocks_of_finished_requests_keep_their_parents():
    core = make_core(num_blocks=64)
    for i in range(3):
        # 1 prompt block + 3 generated (the 13th output token is never computed)
        add(core, f"r{i}", [100 + i] * 4, max_tokens=13)
    while core.has_unfinished_requests():
        core.step()
    s = snap(core)  # no snapshot was taken while they ran
    tree = s.prefix_tree
    assert (tree.num_roots, tree.num_in_tree, tree.num_unattached) == (3, 12, 0)
    assert sorted(n.num_blocks_below for n in tree.nodes if n.parent < 0) == [4, 4, 4]
    assert core.xray.recent_chains.maxlen == RECENT_CHAINS + 8 and not core.xray.recent_chains

    # Seen by a snapshot while running, then finished with more generated blocks.
    add(core, "late", [7] * 4, max_tokens=13)
    for _ in range(2):
        core.step()
    assert snap(core).prefix_tree.num_in_tree == 12 + 1
    while core.has_unfinished_requests():
        core.step()
    tree = snap(core).prefix_tree
    assert (tree.num_roots, tree.num_in_tree, tree.num_unattached) == (4, 16, 0)


def test_size_is_bounded_for_a_big_pool():
    core = make_core(num_blocks=20_000, max_num_seqs=4)
    for i in range(10):
        add(core, f"r{i}", [1000 + i] * 40)
    for _ in range(3):
        core.step()
    limits = {"max_requests": 2, "max_block_ids": 15, "max_map_cells": 1000,
              "max_tree_nodes": 7, "num_eviction_head": 5}
    s = snap(core, **limits)
    assert (s.num_running, s.num_waiting, len(s.running), len(s.waiting)) == (4, 6, 2, 2)
    assert [sum(n for _, n in r.block_runs) for r in s.running] == [11, 4]  # 15 ids in all
    assert [r.num_blocks for r in s.running] == [11, 11]
    assert s.blocks.cell_size == 20 and sum(n for _, _, n in s.blocks.runs) == 1000
    # 44 blocks in use: cells 0-1 (ids 0-39) in use, then cell 2 (40-59) holds 4 more.
    assert s.blocks.runs == [(IN_USE, 1, 3), (FREE, 0, 997)]
    assert len(s.blocks.eviction_head) == 5
    nodes = s.prefix_tree.nodes
    assert len(nodes) == 7 and all(n.parent < i for i, n in enumerate(nodes))
    assert s.prefix_tree.num_in_tree == s.prefix_tree.num_cached_blocks == 40
    assert len(msgspec.json.encode(s)) < 20_000


def test_step_ring_keeps_the_last_steps():
    core = make_core(num_blocks=512, max_num_seqs=4, max_model_len=1024)
    add(core, "long", [5] * 4, max_tokens=STEP_HISTORY + 30)
    for _ in range(STEP_HISTORY + 20):
        core.step()
    steps = snap(core).steps
    assert len(steps.step) == STEP_HISTORY
    assert steps.step[0] == 21 and steps.step[-1] == STEP_HISTORY + 20
    assert all(len(getattr(steps, f)) == STEP_HISTORY for f in steps.__struct_fields__)


def test_helpers():
    assert id_runs([7, 8, 9, 3, 4, 12]) == [(7, 3), (3, 2), (12, 1)]
    assert id_runs([]) == []
    import numpy as np

    kinds, refs = np.array([0, 0, 2, 2, 2, 1]), np.array([0, 0, 1, 1, 3, 0])
    assert run_length(kinds, refs) == [(0, 0, 2), (2, 1, 2), (2, 3, 1), (1, 0, 1)]


def test_snapshot_crosses_the_ipc_as_typed_msgpack():
    core = make_core(num_blocks=16)
    add(core, "a", PROMPT_A)
    core.step()
    call = core_codec().decode(frontend_codec().encode(XrayCall(7, XrayLimits(max_tree_nodes=3))))
    assert call == XrayCall(7, XrayLimits(max_tree_nodes=3))
    result = XrayResult(7, snapshot=core.xray_snapshot(call.limits))
    decoded = frontend_codec().decode(core_codec().encode(result))
    assert isinstance(decoded, XrayResult) and decoded == result
    assert isinstance(decoded.snapshot, XraySnapshot)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_queue_order(policy):
    config = EngineConfig(
        model_config=ModelConfig(model="fake", max_model_len=256),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=1, policy=policy),
    )
    core = EngineCore(config, FakeExecutor(config, vocab_size=1000, num_blocks=64))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for req_id, priority in (("first", 5), ("second", 9), ("third", 1)):
        core.add_request(EngineCoreRequest(req_id, [ord(req_id[0])] * 4, params,
                                           priority=priority))
    core.step()
    s = snap(core)
    assert [r.req_id for r in s.running] == ["first" if policy == "fcfs" else "third"]
    expected = ["second", "third"] if policy == "fcfs" else ["first", "second"]
    assert [r.req_id for r in s.waiting] == expected
    assert [r.priority for r in s.waiting] == [{"first": 5, "second": 9, "third": 1}[r]
                                               for r in expected]


def test_every_field_is_documented():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "xray.md").read_text()
    assert f"(`schema_version` {SCHEMA_VERSION})" in doc
    for struct in (XraySnapshot, XrayConfig, XrayRequest, XrayBlockMap, XrayTreeNode,
                   XrayPrefixTree, XraySteps):
        for field in struct.__struct_fields__:
            assert f"`{field}`" in doc, f"docs/xray.md does not describe {struct.__name__}.{field}"
