"""Paged KV cache bookkeeping: blocks, the free queue, the pool and the manager."""

from engine.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache.block_hash import BlockHash, BlockHasher, get_hash_fn, hash_block_tokens
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "get_hash_fn",
    "hash_block_tokens",
]
