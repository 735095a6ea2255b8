"""CUDA graphs for decode steps: capture once per batch size, pad, replay.

A pure-decode step (every request schedules one token) of `n` requests runs as the
graph of the smallest captured size `B >= n`. The graph reads its inputs from
persistent buffers whose addresses never change; each step copies its real rows in
and fills the rows past `n` with a harmless dummy decode, then replays:

    step (n = 5)  --copy rows 0..4, pad rows 5..7-->  buffers[:8]  --replay graph 8-->
    hidden[:8]  --keep rows 0..4-->  sampler

Padded rows are one-token decodes at position 0 of the *padding block*, a block
one past the pool's last (`kv_cache_init.allocate_kv_caches` allocates it; the
block pool never hands it out). They write their K/V there and attend to that one
key, so every backend runs them like any other decode, no NaN appears, and no real
block is ever written.

Off CUDA, or with `--enforce-eager`, there is no graph. The same padded,
buffer-backed path can still run eagerly (`DecodeGraphConfig(capture=False)`): CPU
tests use that to check the padding and buffers without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.attention.backends.base import AttentionBackend
from engine.attention.forward_context import set_forward_context
from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# Above this many requests a decode step runs eagerly (vLLM's default cap, 512).
MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, until one holds the seat budget.

    max_num_seqs 20 -> (1, 2, 4, 8, 16, 24): 24 covers every batch the scheduler can
    form (20 pads to 24); max_num_seqs 3 -> (1, 2, 4).
    """
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes: list[int] = []
    for size in (1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)):
        sizes.append(size)
        if size >= limit:
            break
    return tuple(sizes)


def padded_size(num_reqs: int, capture_sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size >= num_reqs, or None when there is none.

    capture_sizes (1, 2, 4, 8): 1 -> 1, 3 -> 4, 5 -> 8, 9 -> None (runs eagerly).
    """
    for size in capture_sizes:  # ascending
        if size >= num_reqs:
            return size
    return None


@dataclass(frozen=True)
class DecodeGraphConfig:
    """How decode steps run. Built once by the executor, read by the runner."""

    capture_sizes: tuple[int, ...]  # ascending; empty: every step runs eagerly, unpadded
    capture: bool  # True: record a CUDA graph per size; False: run the padded path eagerly

    @property
    def enabled(self) -> bool:
        return bool(self.capture_sizes)

    @staticmethod
    def for_device(device: torch.device, enforce_eager: bool,
                   max_num_seqs: int) -> DecodeGraphConfig:
        """Graphs on CUDA unless --enforce-eager; no padded path anywhere else."""
        if device.type != "cuda" or enforce_eager:
            return DecodeGraphConfig((), capture=False)
        return DecodeGraphConfig(default_capture_sizes(max_num_seqs), capture=True)


@dataclass
class DecodeBuffers:
    """The persistent inputs every graph reads; allocated once, rows rewritten each step."""

    input_ids: torch.Tensor  # int64 [max_size]
    positions: torch.Tensor  # int64 [max_size]
    slot_mapping: torch.Tensor  # int64 [max_size]
    seq_lens: torch.Tensor  # int32 [max_size]
    query_start_loc: torch.Tensor  # int32 [max_size + 1], always 0, 1, 2, ...: one token each
    block_table: torch.Tensor  # int32 [max_size, max_num_blocks_per_req]

    @staticmethod
    def allocate(max_size: int, max_num_blocks_per_req: int,
                 device: torch.device) -> DecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return DecodeBuffers(
            input_ids=zeros(max_size, dtype=torch.int64),
            positions=zeros(max_size, dtype=torch.int64),
            slot_mapping=zeros(max_size, dtype=torch.int64),
            seq_lens=zeros(max_size, dtype=torch.int32),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            block_table=zeros(max_size, max_num_blocks_per_req, dtype=torch.int32),
        )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden_states: torch.Tensor  # [size, hidden]: the graph's output, overwritten by replay


class DecodeGraphRunner:
    """Runs pure-decode steps padded to a captured size, from persistent buffers.

    `fits(metadata)` says whether a step can take this path; `run(...)` returns the
    hidden states of the step's real rows, exactly what the eager forward returns
    for the same inputs (up to the floating-point effect of a larger batch).
    """

    def __init__(
        self,
        config: DecodeGraphConfig,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        max_num_blocks_per_req: int,
    ):
        assert config.enabled
        self.config = config
        self.model = model
        self.backend = backend
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.buffers = DecodeBuffers.allocate(config.capture_sizes[-1], max_num_blocks_per_req,
                                              device)
        self.padding_block_id: int | None = None  # set by set_padding_block
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0  # steps that took this path (tests read it)

    def set_padding_block(self, padding_block_id: int) -> None:
        """The block padded rows write to: one no request owns (see the module docstring)."""
        self.padding_block_id = padding_block_id

    def fits(self, metadata: AttentionMetadata) -> bool:
        """A pure-decode step with a captured size at least its batch (and graphs ready)."""
        return (
            self.padding_block_id is not None
            and metadata.max_query_len == 1
            and metadata.num_actual_tokens == metadata.num_reqs
            and padded_size(metadata.num_reqs, self.config.capture_sizes) is not None
            and (not self.config.capture or bool(self.graphs))
        )

    # ------------------------------------------------------------------ per step
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n real rows."""
        num_reqs = metadata.num_reqs
        size = padded_size(num_reqs, self.config.capture_sizes)
        assert size is not None and self.fits(metadata)
        self._fill(input_ids, positions, metadata, size)
        self.num_replays += 1
        if self.config.capture:
            graph = self.graphs[size]
            graph.graph.replay()
            return graph.hidden_states[:num_reqs]
        # Eager, graph-shaped: the same buffers and padding, host copies for the CPU backend.
        seq_lens_np = np.ones(size, dtype=np.int32)
        seq_lens_np[:num_reqs] = metadata.seq_lens_np
        hidden_states = self._forward(size, self._metadata(size, seq_lens_np))
        return hidden_states[:num_reqs]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
              metadata: AttentionMetadata, size: int) -> None:
        """Copy the n real rows into the buffers and make rows n..size-1 padding.

        Worked example: n = 5 requests padded to size 8, block_size 16, a pool of
        100 blocks (ids 0..99) so the padding block is 100:

            row            0..4 (real)               5, 6, 7 (padding)
            input_ids      the step's tokens         0
            positions      each request's position   0
            slot_mapping   its real slot             100 * 16 + 0 = 1600
            seq_lens       its context length        1
            block_table    its block ids             [100, <stale>, ...]
            query_start_loc = [0, 1, 2, ..., 8]      (one token per row, set once)

        A padded row attends to key 0 of block 100 only (seq_len 1), the key it
        just wrote: finite, read by no real row. Stale columns of the block table
        are never read (a row reads blocks 0 .. (seq_len - 1) // block_size).
        """
        assert self.padding_block_id is not None
        n = metadata.num_reqs
        buffers = self.buffers
        buffers.input_ids[:n].copy_(input_ids[:n])
        buffers.positions[:n].copy_(positions[:n])
        buffers.slot_mapping[:n].copy_(metadata.slot_mapping[:n])
        buffers.seq_lens[:n].copy_(metadata.seq_lens)
        num_blocks = metadata.block_table.shape[1]
        buffers.block_table[:n, :num_blocks].copy_(metadata.block_table)
        if size > n:
            buffers.input_ids[n:size] = 0
            buffers.positions[n:size] = 0
            buffers.slot_mapping[n:size] = self.padding_block_id * self.block_size
            buffers.seq_lens[n:size] = 1
            buffers.block_table[n:size, 0] = self.padding_block_id

    def _metadata(self, size: int, seq_lens_np: np.ndarray) -> AttentionMetadata:
        """Metadata over the first `size` buffer rows; its Python values are the same for
        every step of this size (a graph bakes them in): max_seq_len is the model's."""
        buffers = self.buffers
        return AttentionMetadata(
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=buffers.query_start_loc[: size + 1],
            seq_lens=buffers.seq_lens[:size],
            block_table=buffers.block_table[:size],
            slot_mapping=buffers.slot_mapping[:size],
            query_start_loc_np=np.arange(size + 1, dtype=np.int32),
            seq_lens_np=seq_lens_np,
        )

    def _forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(metadata, self.backend):
            return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, sharing one memory pool.

        Every row is a padding row while capturing, so capture writes only the
        padding block. A model whose forward cannot be captured (one that reads a
        device value on the host, like the MoE layer's expert counts) is left
        eager, with a warning.
        """
        assert self.config.capture and self.padding_block_id is not None
        if not self.backend.cuda_graph_safe:
            logger.warning("CUDA graphs disabled, decode runs eagerly: the %s attention "
                           "backend plans on the host each step", self.backend.name)
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in reversed(self.config.capture_sizes):
                metadata = self._padding_metadata(size)
                self._forward(size, metadata)  # warm-up: Triton compiles, cuBLAS picks kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden_states = self._forward(size, metadata)
                self.graphs[size] = _Graph(graph, hidden_states)
        except Exception as error:  # CUDA errors (AcceleratorError) and host-sync refusals
            self.graphs.clear()
            logger.warning("CUDA graphs disabled, decode runs eagerly: capture failed (%s)",
                           str(error).splitlines()[0])
            return
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), list(self.config.capture_sizes),
                    time.perf_counter() - start)

    def _padding_metadata(self, size: int) -> AttentionMetadata:
        """All `size` rows set to padding rows (what capture runs on)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        nothing = AttentionMetadata(
            num_actual_tokens=0, max_query_len=1, max_seq_len=1,
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.device),
            seq_lens=empty.int(), block_table=empty.int().view(0, 0), slot_mapping=empty,
            query_start_loc_np=np.zeros(1, np.int32), seq_lens_np=np.zeros(0, np.int32),
        )
        self._fill(empty, empty, nothing, size)
        return self._metadata(size, np.ones(size, dtype=np.int32))
