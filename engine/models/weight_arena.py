"""A loaded CPU model's weights moved into one arena backed by 2 MiB pages.

At one client a decode step streams every weight once, so its time is about the bytes read
over the memory bandwidth. Loading leaves the weights scattered over the heap in 4 KiB
pages (each repack, concatenation and quantization allocates its own tensor): a step of the
1B Q4_K_M touches ~170,000 pages, and each first touch misses the TLB. Moved into one arena
of transparent huge pages (madvise MADV_HUGEPAGE, which the kernel's default THP setting
"madvise" honours) in module order, a step touches a few hundred pages, in the order the
forward reads them.

The move keeps every tensor object: `Tensor.set_` points it at its bytes in the arena, so
whatever holds the tensor (a Parameter, a QuantizedWeight) sees the new memory. Only
tensors that are the whole of their own storage move (a view into a mapped file or into
another tensor stays where it is); tied weights move once. While moving, the process holds
both copies (the old heap is handed back right after, by the loader's malloc_trim), so the
move is skipped (and logged) where the machine's available memory could not hold a second
copy with room to spare.

`PAGEDSERVE_WEIGHT_ARENA=0` leaves the weights where loading put them.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
from torch import nn

from engine import cpu_info

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line (and on its element size)
MADV_HUGEPAGE = 14  # Linux


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_WEIGHT_ARENA", "1") != "0"


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every weight tensor of `model`, each once, in module order: each module's own
    parameters and buffers, then its packed weight (a Linear's `quantized`, a
    VocabEmbedding's `packed`: their `tensors()`)."""
    seen: set[int] = set()
    tensors = []
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for packed in (getattr(module, "quantized", None), getattr(module, "packed", None)):
            if packed is not None:
                own += packed.tensors()
        for tensor in own:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


def movable(tensor: torch.Tensor) -> bool:
    """A CPU tensor that is all of its own storage (not a view, not a mapped file's bytes)."""
    return (tensor.device.type == "cpu" and tensor.numel() > 0 and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def move_into_arena(model: nn.Module) -> int:
    """Move `model`'s movable weights into one huge-page arena; returns the bytes moved
    (0 when disabled or nothing moves)."""
    if not enabled():
        return 0
    tensors, storages = [], set()
    for tensor in model_tensors(model):
        if movable(tensor) and tensor.untyped_storage().data_ptr() not in storages:
            storages.add(tensor.untyped_storage().data_ptr())
            tensors.append(tensor)
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    total = sum(_aligned(size) for size in sizes)
    if total == 0:
        return 0
    if 2 * total > cpu_info.available_memory_bytes():
        logger.info("weights stay in 4 KiB pages: a second copy of their %.1f MiB (the move "
                    "to 2 MiB pages) would need more than half the available memory",
                    total / 2**20)
        return 0
    # One allocation with room to start on a 2 MiB boundary. Example: the buffer at
    # 0x7f00_0012_3440 starts the arena at 0x7f00_0020_0000 (offset 0xdcbc0).
    buffer = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    _advise_huge_pages(buffer.data_ptr() + start, total)
    storage, offset = buffer.untyped_storage(), start
    with torch.no_grad():
        for tensor, size in zip(tensors, sizes, strict=True):
            place = buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            place.copy_(tensor)
            tensor.set_(storage, offset // tensor.element_size(), tensor.shape, tensor.stride())
            offset += _aligned(size)
    logger.info("weights: %.1f MiB in one arena of 2 MiB pages (%d tensors)",
                total / 2**20, len(tensors))
    return total


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _advise_huge_pages(address: int, length: int) -> None:
    """Ask for transparent huge pages over [address, address + length) (Linux; a no-op
    where madvise is missing or refuses)."""
    libc = cpu_info.libc()
    if libc is not None and hasattr(libc, "madvise"):
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE)
