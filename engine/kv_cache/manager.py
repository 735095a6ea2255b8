"""KVCacheManager: which blocks each request holds (per KV-cache group), prefix lookups,
allocation."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_hash import BlockHash
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.groups import KVCacheGroupSpec
from engine.kv_cache.single_type import FullAttentionBlocks, SlidingWindowBlocks, cdiv

# The null block's hash: set so that caching skips it (never a real block's digest).
NULL_BLOCK_HASH = b"null-block"


class Request(Protocol):
    """What the manager reads of a request: engine.request.Request (which imports this
    package for its block hashes, so the manager names it only by shape)."""

    req_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    sampling_params: Any  # SamplingParams: only .prompt_logprobs is read

    @property
    def num_tokens(self) -> int: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset, counted in tokens."""

    num_requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Maps requests to KV blocks on top of a `BlockPool`, per KV-cache group.

    A model with one kind of attention has one group (every layer): then
    `req_to_blocks[req_id]` lists the request's blocks in token order, token `t` in
    block `req_to_blocks[req_id][t // block_size]` at offset `t % block_size`. A model
    mixing full and sliding-window layers (engine.kv_cache.groups) has several; the
    manager coordinates them like vLLM's hybrid coordinator: each group keeps its own
    list of the same length (engine.kv_cache.single_type), all draw from the one pool,
    a prefix hit is the longest that every group can serve, and an allocation counts
    the blocks of every group. `req_to_blocks` is group 0's.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: list[KVCacheGroupSpec] | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.group_specs = groups or [KVCacheGroupSpec(None, ())]
        # Stands for the blocks a sliding window no longer needs: the cache's padding
        # block id (num_blocks), never in the pool, "hashed" so nothing caches it.
        self.null_block = KVCacheBlock(num_blocks)
        self.null_block.block_hash = NULL_BLOCK_HASH
        self.groups = [
            FullAttentionBlocks(self.block_pool, block_size, group_id, self.null_block)
            if spec.sliding_window is None else
            SlidingWindowBlocks(self.block_pool, block_size, group_id, self.null_block,
                                spec.sliding_window)
            for group_id, spec in enumerate(self.group_specs)
        ]
        self._sliding_groups = [g for g in self.groups if g.sliding_window is not None]
        self.req_to_blocks = self.groups[0].req_to_blocks
        self.num_cached_blocks = self.groups[0].num_cached_blocks
        # req_id -> the tokens (computed + new) the request may reach with nothing to
        # do: within the blocks it holds, short of completing an unhashed block or of
        # a window sliding past a block. A decode step below it returns at once (most
        # steps: one in block_size works).
        self._no_work_until: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_tokens_fit(self, max_num_new_tokens: int) -> int:
        """The longest request the pool holds on its own, when each step computes at
        most `max_num_new_tokens` of it: every full-attention group needs a block per
        block_size tokens, a sliding-window group at most its window's plus a step's.
        Example: 100 blocks of 16, groups full + 2 x sliding W 32, steps of 16 tokens:
        each sliding group holds <= cdiv(31 + 16, 16) + 1 = 4 -> (100 - 8) * 16 tokens."""
        num_full = sum(1 for g in self.groups if g.sliding_window is None)
        num_sliding_blocks = sum(
            cdiv(g.sliding_window - 1 + max_num_new_tokens, self.block_size) + 1
            for g in self._sliding_groups)
        if num_full == 0:  # only windows: any length, if one window's worth fits
            return sys.maxsize if num_sliding_blocks <= self.num_blocks else 0
        return max(0, (self.num_blocks - num_sliding_blocks) // num_full) * self.block_size

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`: (group 0's blocks, number of tokens
        they hold). With several groups it is the longest every group serves: a
        sliding-window group needs only the blocks of the window before its end.

        A pure lookup: the prefix-cache stats count it only when `allocate_slots`
        then admits the request, so a request retried while the cache is full is
        counted once.

        The last token is never taken from the cache: even a fully cached prompt
        computes one token, to get the logits of the next one.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if len(self.groups) == 1:
            hit_blocks = self.groups[0].find_hit(hashes, max_hit_blocks)
            return hit_blocks, len(hit_blocks) * self.block_size
        # Shrink the hit until every group serves all of it: a shorter hit can need
        # other blocks of a sliding window, so ask every group again after a change.
        num_hit_blocks, changed = min(max_hit_blocks, len(hashes)), True
        while changed:
            changed = False
            for group in self.groups:
                found = len(group.find_hit(hashes, num_hit_blocks))
                if found < num_hit_blocks:
                    num_hit_blocks, changed = found, True
        hit_blocks = self.groups[0].find_hit(hashes, num_hit_blocks)
        return hit_blocks, num_hit_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        `new_computed_blocks` are prefix-cache hits (group 0's, from
        `get_computed_blocks`) that the request takes now; the other groups' hits of
        the same length are looked up again here. Returns group 0's newly allocated
        blocks (possibly empty; every other group got as many, at the end of its
        list), or None if the pool cannot hold them; on None no block was taken (a
        sliding window may have released blocks it no longer needed).
        """
        if not new_computed_blocks and (request.num_computed_tokens + num_new_tokens
                                        <= self._no_work_until.get(request.req_id, -1)):
            return []  # the common decode step (see `_no_work_until`)
        req_id = request.req_id
        hits = self._hits_of_every_group(request, new_computed_blocks or [])
        for group in self._sliding_groups:
            group.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_held = len(self.groups[0].req_to_blocks.get(req_id, ()))
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after_step = num_computed_tokens + num_new_tokens
        num_required_blocks = cdiv(num_tokens_after_step, self.block_size)
        num_new_blocks = max(0, num_required_blocks - num_held - len(hits[0]))
        # Hits on free blocks take those blocks out of the free pool as well.
        null = self.null_block
        num_hits_on_free = sum(1 for group_hits in hits for b in group_hits
                               if b.ref_cnt == 0 and b is not null) if hits[0] else 0
        if (num_new_blocks * len(self.groups) + num_hits_on_free
                > self.block_pool.get_num_free_blocks()):
            if not num_held:
                for group in self.groups:
                    group.req_to_blocks.pop(req_id, None)
            return None

        if request.num_computed_tokens == 0:  # admission: count the prefix lookup
            self._count_prefix_lookup(request, num_new_computed_tokens)
        new_blocks: list[KVCacheBlock] = []
        for group, group_hits in zip(self.groups, hits, strict=True):
            req_blocks = group.req_to_blocks.setdefault(req_id, [])
            if group_hits:
                self.block_pool.touch(b for b in group_hits if b is not null)
                req_blocks.extend(group_hits)
                if group.sliding_window is not None:  # the window's nulls come first
                    group.num_skipped[req_id] = sum(1 for b in group_hits if b is null)
            if num_new_blocks:
                group_new = self.block_pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(group_new)
                if group is self.groups[0]:
                    new_blocks = group_new

        if self.enable_caching:
            # Blocks that will be full after this step get their hash now: their KV is
            # written by this step's forward pass before any later step can read it.
            num_full_blocks = min(
                num_tokens_after_step // self.block_size, len(request.block_hashes)
            )
            for group in self.groups:
                newly = group.cache_full_blocks(req_id, request.block_hashes, num_full_blocks)
                if newly and group is self.groups[0] and self.block_pool.events is not None:
                    self._log_stored(request, newly)
        self._no_work_until[req_id] = self._tokens_without_work(req_id)
        return new_blocks

    def _log_stored(self, request: Request, newly: list[int]) -> None:
        """One BlockStored per run of consecutive new entries (block indices of the
        request). Example, block size 4, newly [2, 3]: hashes h2, h3, parent h1, the
        tokens at positions 8 .. 15."""
        runs: list[list[int]] = []
        for index in newly:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        for run in runs:
            parent = hashes[run[0] - 1] if run[0] > 0 else None
            # A block's hash covers the salt and adapter (the first block) and the images
            # it holds (block_hash.py): say so.
            extra = [request.block_extra_keys(i) for i in run]
            self.block_pool.events.stored([hashes[i] for i in run], parent,
                                          tokens[run[0] * size:(run[-1] + 1) * size], extra,
                                          request.lora_request)

    def _hits_of_every_group(self, request: Request, group0_hits: list[KVCacheBlock]
                             ) -> list[list[KVCacheBlock]]:
        """Each group's hit blocks for the hit `get_computed_blocks` found (group 0's
        given; the others looked up again for the same length, which they all serve:
        nothing was evicted since, the scheduler admits right after the lookup)."""
        if len(self.groups) == 1 or not group0_hits:
            return [group0_hits] + [[] for _ in self.groups[1:]]
        hits = [group0_hits]
        for group in self.groups[1:]:
            group_hits = group.find_hit(request.block_hashes, len(group0_hits))
            assert len(group_hits) == len(group0_hits), "prefix hit changed since the lookup"
            hits.append(group_hits)
        return hits

    def _tokens_without_work(self, req_id: str) -> int:
        """How many tokens (computed + new) `req_id` may reach before a call needs
        new blocks or must hash a block: e.g. block_size 16, 5 blocks held, 3 of them
        hashed -> min(5 * 16, 4 * 16 - 1) = 63 (token 64 completes block 3); with a
        sliding window also before its window passes its first held block."""
        num_held_tokens = len(self.req_to_blocks[req_id]) * self.block_size
        limit = num_held_tokens
        if self.enable_caching:
            num_hashed = self.num_cached_blocks.get(req_id, 0)
            limit = min(limit, (num_hashed + 1) * self.block_size - 1)
        for group in self._sliding_groups:
            limit = min(limit, group.tokens_until_skip(req_id))
        return limit

    def _count_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def free(self, request: Request, discard_cached: bool = False,
             num_written_tokens: int | None = None) -> None:
        """Release every block of `request` in every group (tail first); safe to call
        twice.

        `discard_cached=True` (after a failed step, whose KV may never have been
        written) also removes the blocks' hashes so no later request can hit them.
        `num_written_tokens`: only the KV of the first that many tokens is written
        (a request preempted after being scheduled: `allocate_slots` hashed the
        blocks its step would fill, and that step will not run for it); blocks past
        them lose their hashes. E.g. block_size 4, 9 tokens written: blocks 0 and 1
        keep their hashes, blocks 2.. lose theirs.
        """
        for group in self.groups:
            group.free(request.req_id, discard_cached, num_written_tokens)
        self._no_work_until.pop(request.req_id, None)

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
        for group in self.groups:  # every group's list has the same length
            group_blocks = group.req_to_blocks[request.req_id]
            freed = [block for block in group_blocks[num_kept:] if block is not self.null_block]
            del group_blocks[num_kept:]
            assert all(block.block_hash is None for block in freed)
            self.block_pool.free_blocks(reversed(freed))
        self._no_work_until[request.req_id] = self._tokens_without_work(request.req_id)
        return num_kept

    def get_block_ids(self, req_id: str) -> list[int]:
        """Group 0's block ids of `req_id`, in token order."""
        return [block.block_id for block in self.req_to_blocks.get(req_id, [])]

    def get_extra_group_block_ids(self, req_id: str) -> list[list[int]]:
        """The block ids of groups 1.. of `req_id` (empty for a one-group model); a
        sliding-window group's skipped blocks are the null block's id."""
        return [[block.block_id for block in group.req_to_blocks.get(req_id, [])]
                for group in self.groups[1:]]

    def num_blocks_held(self, req_id: str) -> list[int]:
        """Blocks `req_id` holds in each group (a sliding window's nulls not counted)."""
        return [group.num_held(req_id) for group in self.groups]

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The stats since the last call; resets the counters."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
