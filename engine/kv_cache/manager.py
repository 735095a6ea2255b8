"""KVCacheManager: which blocks each request holds, prefix lookups, allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_hash import BlockHash
from engine.kv_cache.block_pool import BlockPool


class Request(Protocol):
    """What the manager reads of a request: engine.request.Request (which imports this
    package for its block hashes, so the manager names it only by shape)."""

    req_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    sampling_params: Any  # SamplingParams: only .prompt_logprobs is read

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens."""

    num_requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Maps requests to KV blocks on top of a `BlockPool`.

    `req_to_blocks[req_id]` lists the request's blocks in token order: token `t`
    of the request lives in block `req_to_blocks[req_id][t // block_size]` at
    offset `t % block_size`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks already carry their hash.
        self.num_cached_blocks: dict[str, int] = {}
        # req_id -> the tokens (computed + new) the request may reach with nothing to
        # do: within the blocks it holds, short of completing an unhashed block. A
        # decode step below it returns at once (most steps: one in block_size works).
        self._no_work_until: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`: (blocks, number of tokens they hold).

        A pure lookup: the prefix-cache stats count it only when `allocate_slots`
        then admits the request, so a request retried while the cache is full is
        counted once.

        The last token is never taken from the cache: even a fully cached prompt
        computes one token, to get the logits of the next one.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        max_hit_blocks = max_hit_tokens // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain is broken: no later block can match
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`)
        that the request takes now. Returns the newly allocated blocks (possibly
        empty), or None if the pool cannot hold them; on None nothing changed.
        """
        if not new_computed_blocks and (request.num_computed_tokens + num_new_tokens
                                        <= self._no_work_until.get(request.req_id, -1)):
            return []  # the common decode step (see `_no_work_until`)
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.req_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after_step = num_computed_tokens + num_new_tokens
        num_required_blocks = cdiv(num_tokens_after_step, self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        # Hits on free blocks take those blocks out of the free pool as well.
        num_hits_on_free = (
            sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        )
        if num_new_blocks + num_hits_on_free > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.req_id]
            return None

        if request.num_computed_tokens == 0:  # admission: count the prefix lookup
            self._count_prefix_lookup(request, num_new_computed_tokens)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if num_new_blocks:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []  # the common decode step: its token fits in the last block

        if self.enable_caching:
            # Blocks that will be full after this step get their hash now: their KV is
            # written by this step's forward pass before any later step can read it.
            num_full_blocks = min(
                num_tokens_after_step // self.block_size, len(request.block_hashes)
            )
            num_cached = self.num_cached_blocks.get(request.req_id, 0)
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full_blocks
                )
                self.num_cached_blocks[request.req_id] = num_full_blocks
        self._no_work_until[request.req_id] = self._tokens_without_work(request.req_id)
        return new_blocks

    def _tokens_without_work(self, req_id: str) -> int:
        """How many tokens (computed + new) `req_id` may reach before a call needs
        new blocks or must hash a block: e.g. block_size 16, 5 blocks held, 3 of them
        hashed -> min(5 * 16, 4 * 16 - 1) = 63 (token 64 completes block 3)."""
        num_held_tokens = len(self.req_to_blocks[req_id]) * self.block_size
        if not self.enable_caching:
            return num_held_tokens
        num_hashed = self.num_cached_blocks.get(req_id, 0)
        return min(num_held_tokens, (num_hashed + 1) * self.block_size - 1)

    def _count_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def free(self, request: Request, discard_cached: bool = False,
             num_written_tokens: int | None = None) -> None:
        """Release every block of `request` (tail first); safe to call twice.

        `discard_cached=True` (after a failed step, whose KV may never have been
        written) also removes the blocks' hashes so no later request can hit them.
        `num_written_tokens`: only the KV of the first that many tokens is written
        (a request preempted after being scheduled: `allocate_slots` hashed the
        blocks its step would fill, and that step will not run for it); blocks past
        them lose their hashes. E.g. block_size 4, 9 tokens written: blocks 0 and 1
        keep their hashes, blocks 2.. lose theirs.
        """
        blocks = self.req_to_blocks.pop(request.req_id, [])
        if discard_cached:
            self.block_pool.uncache_blocks(blocks)
        elif num_written_tokens is not None:
            self.block_pool.uncache_blocks(blocks[num_written_tokens // self.block_size:])
        self.num_cached_blocks.pop(request.req_id, None)
        self._no_work_until.pop(request.req_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> int | None:
        """Free `request`'s tail blocks past the first `num_tokens` tokens (speculative
        decoding: the slots of rejected draft tokens). Returns the request's block count
        when blocks were freed, else None.

        Example: block_size 4, 3 blocks held for 11 slots, 6 tokens kept -> block 2 is
        freed (blocks 0 and 1 hold tokens 0..7). Freed blocks were never hashed: a hash
        covers only full blocks of the request's real tokens.
        """
        blocks = self.req_to_blocks.get(request.req_id)
        num_kept = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= num_kept:
            return None
        freed = blocks[num_kept:]
        del blocks[num_kept:]
        assert all(block.block_hash is None for block in freed)
        self.block_pool.free_blocks(reversed(freed))
        self._no_work_until[request.req_id] = self._tokens_without_work(request.req_id)
        return num_kept

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, [])]

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call; resets the counters."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
