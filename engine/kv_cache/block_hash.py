"""Hash-chained block hashes for prefix caching.

A full block's hash is H(parent_hash, token_ids_of_block, extra_keys). Because the
parent's hash is an input, two blocks with the same tokens match only if every block
before them matched too:

    tokens (block_size=4):  你 喜 不 喜 | 欢 吃 苹 果
    hashes:                 h0=H(None, 你喜不喜) | h1=H(h0, 欢吃苹果)

    tokens:                 他 喜 不 喜 | 欢 吃 苹 果
    hashes:                 g0=H(None, 他喜不喜) | g1=H(g0, 欢吃苹果)   -> g1 != h1

Partial blocks are never hashed. `extra_keys` of the first block carry the request's
`cache_salt` and its LoRA adapter, and those of every block an image's placeholder run
touches carry that image's content hash (engine/request.py `block_extra_keys`), so tenants
with different salts, requests of different adapters, and prompts of different images
never share a prefix (past the image).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

BlockHash = bytes
HashFn = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional and fast; not collision-resistant against adversaries

    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": _sha256, "xxhash": _xxh3_128}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown prefix-caching hash {name!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """H(parent_hash, token_ids, extra_keys) as bytes; deterministic across processes."""
    parts = [
        parent_hash or b"\x00root",
        np.asarray(token_ids, dtype=np.int64).tobytes(),
        repr(extra_keys).encode() if extra_keys else b"",
    ]
    # Length-prefix each part so that no two different inputs concatenate equally.
    payload = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hash_fn(payload)


class BlockHasher:
    """Computes the hashes of a request's newly completed full blocks, once each."""

    def __init__(self, block_size: int, hash_fn: HashFn):
        self.block_size = block_size
        self.hash_fn = hash_fn

    def new_block_hashes(
        self,
        token_ids: Sequence[int],
        existing: Sequence[BlockHash],
        extra_keys_of: Callable[[int], tuple[Any, ...] | None] | None = None,
    ) -> list[BlockHash]:
        """Hashes for full blocks of `token_ids` beyond the `existing` ones; block i's
        also covers `extra_keys_of(i)` (None: nothing else)."""
        hashes: list[BlockHash] = []
        parent = existing[-1] if existing else None
        block_index = len(existing)
        while (block_index + 1) * self.block_size <= len(token_ids):
            start = block_index * self.block_size
            extra = extra_keys_of(block_index) if extra_keys_of is not None else None
            parent = hash_block_tokens(
                self.hash_fn, parent, token_ids[start : start + self.block_size], extra
            )
            hashes.append(parent)
            block_index += 1
        return hashes
