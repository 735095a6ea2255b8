"""The CUDA-graph decode path, checked on the CPU: sizes, padding, persistent buffers.

Off CUDA nothing is captured, but `DecodeGraphConfig(capture=False)` runs the very
path a graph replays (copy into the persistent buffers, pad to the captured size,
forward over the buffers, keep the real rows) eagerly. The GPU tests
(tests/gpu/test_gpu_parity.py) replay real graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM
from engine.attention.backends.torch_backend import TorchAttentionBackend
from engine.attention.forward_context import set_forward_context
from engine.attention.metadata import AttentionMetadata
from engine.worker import kv_cache_init
from engine.worker.cuda_graphs import (
    DecodeGraphConfig,
    DecodeGraphRunner,
    default_capture_sizes,
    padded_size,
)
from tests.support.correctness import assert_all_three_match, hf_reference, make_prompts
from tests.support.model_fixtures import build_tiny_checkpoint

BLOCK_SIZE = 16
EAGER_PADDED = DecodeGraphConfig(capture_sizes=(1, 2, 4, 8), capture=False)


def test_capture_sizes():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(3) == (1, 2, 4)
    assert default_capture_sizes(8) == (1, 2, 4, 8)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert default_capture_sizes(128)[-3:] == (112, 120, 128)
    assert default_capture_sizes(4096)[-1] == 512  # capped: larger decode batches run eagerly
    sizes = (1, 2, 4, 8)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_graphs_only_on_cuda_without_enforce_eager():
    assert not DecodeGraphConfig.for_device(torch.device("cpu"), False, 64).enabled
    assert not DecodeGraphConfig.for_device(torch.device("cuda"), True, 64).enabled
    on_cuda = DecodeGraphConfig.for_device(torch.device("cuda"), False, 20)
    assert on_cuda.capture and on_cuda.capture_sizes == (1, 2, 4, 8, 16, 24)


def step_metadata(context_lens: list[int], query_lens: list[int],
                  block_tables: list[list[int]]) -> AttentionMetadata:
    """A step's metadata, built as the runner builds it (positions from context_lens)."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = np.asarray(context_lens, np.int32) + np.asarray(query_lens, np.int32)
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for ctx, q, table in zip(context_lens, query_lens, block_tables, strict=True)
             for p in range(ctx, ctx + q)]
    width = max(len(t) for t in block_tables)
    table = np.array([t + [0] * (width - len(t)) for t in block_tables], np.int32)
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens), block_table=torch.from_numpy(table),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                 max_position_embeddings=512)


def test_padded_decode_matches_eager_and_writes_only_the_padding_block(llama_dir):
    """Five decodes padded to 8: the real rows' hidden states are the eager ones, the
    cache differs from the eager run's in the padding block only."""
    from engine.model_loader import load_model

    model = load_model(llama_dir, torch.float32, "cpu", "none")
    backend = TorchAttentionBackend()
    layers = [m for m in model.modules() if type(m).__name__ == "Attention"]
    specs = kv_cache_init.get_kv_cache_specs(layers, torch.float32, BLOCK_SIZE)
    num_blocks = 12
    caches = kv_cache_init.allocate_kv_caches(specs, num_blocks, torch.device("cpu"),
                                              backend.kv_cache_shape)
    assert caches[0].shape[2] == num_blocks + 1  # the padding block, id 12
    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache

    # Prefill five prompts (lengths straddling blocks), then decode one token each.
    prompt_lens = [3, 17, 30, 8, 1]
    tables = [[0], [1, 2], [3, 4], [5], [6]]
    rng = np.random.default_rng(0)
    prompt_ids = torch.from_numpy(rng.integers(3, 500, sum(prompt_lens)))
    positions = torch.cat([torch.arange(n) for n in prompt_lens])
    with torch.inference_mode():
        with set_forward_context(step_metadata([0] * 5, prompt_lens, tables), backend):
            model(prompt_ids, positions)
        decode = step_metadata(prompt_lens, [1] * 5, tables)
        decode_ids = torch.from_numpy(rng.integers(3, 500, 5))
        decode_pos = torch.tensor(prompt_lens)
        before = [c.clone() for c in caches]
        with set_forward_context(decode, backend):
            eager = model(decode_ids, decode_pos)
        after_eager = [c.clone() for c in caches]
        for layer_cache, saved in zip(caches, before, strict=True):
            layer_cache.copy_(saved)
            layer_cache[:, :, num_blocks] = 7.0  # a sentinel in the padding block

        graphs = DecodeGraphRunner(EAGER_PADDED, model, backend, torch.device("cpu"),
                                   max_model_len=512, block_size=BLOCK_SIZE,
                                   max_num_blocks_per_req=32)
        assert not graphs.fits(decode)  # no padding block yet
        graphs.set_padding_block(num_blocks)
        assert graphs.fits(decode)
        assert not graphs.fits(step_metadata([0], [2], [[0]]))  # a prefill chunk
        padded = graphs.run(decode_ids, decode_pos, decode)

    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert graphs.num_replays == 1
    buffers = graphs.buffers
    # The worked example of DecodeGraphRunner._fill: rows 5..7 are padding.
    assert buffers.slot_mapping[5:8].tolist() == [num_blocks * BLOCK_SIZE] * 3
    assert buffers.seq_lens[:8].tolist() == [4, 18, 31, 9, 2, 1, 1, 1]
    assert buffers.block_table[5:8, 0].tolist() == [num_blocks] * 3
    assert buffers.positions[:8].tolist() == prompt_lens + [0, 0, 0]
    written = torch.zeros(num_blocks * BLOCK_SIZE, dtype=torch.bool)
    written[decode.slot_mapping] = True
    for padded_cache, eager_cache, old in zip(caches, after_eager, before, strict=True):
        # head-major layout [2, Hkv, num_blocks + 1, block_size, D]
        pool, eager_pool = padded_cache[:, :, :num_blocks], eager_cache[:, :, :num_blocks]
        torch.testing.assert_close(pool, eager_pool, rtol=1e-5, atol=1e-5)
        untouched = pool.flatten(2, 3)[:, :, ~written]
        assert torch.equal(untouched, old[:, :, :num_blocks].flatten(2, 3)[:, :, ~written])
        # Padding rows wrote offset 0 of the padding block (token 0's K/V), nothing else.
        assert not padded_cache[:, :, num_blocks, 0].eq(7.0).any()
        assert padded_cache[:, :, num_blocks, 1:].eq(7.0).all()
        assert eager_cache[:, :, num_blocks].eq(0).all()


def test_greedy_parity_through_the_padded_path(llama_dir, monkeypatch):
    """Prefix hits, chunked prefill and preemption at once, every decode step padded
    to 1/2/4/8 and run from the persistent buffers: the same tokens as transformers."""
    monkeypatch.setattr(DecodeGraphConfig, "for_device",
                        staticmethod(lambda device, enforce_eager, max_num_seqs: EAGER_PADDED))
    shared = make_prompts(seed=2, shared_prefix_len=48)
    ref = hf_reference(llama_dir, shared)
    llm = LLM(llama_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=24, max_num_seqs=8)
    runner = llm.engine_core.executor.runner
    assert runner.decode_graphs is not None
    assert_all_three_match(llm, shared, ref)
    assert runner.decode_graphs.num_replays > 20
