"""The x-ray schema: what GET /xray/state returns (docs/xray.md).

The engine core builds an `XraySnapshot` (engine/core/xray.py) when the frontend sends an
`XrayCall` with `XrayLimits` over the IPC; the frontend caches it and fills the few fields
the core never knows (server/http/xray.py). Bump SCHEMA_VERSION when a field changes meaning or
goes away.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1
HASH_HEX_DIGITS = 16  # how much of a block hash a snapshot shows


class XrayLimits(msgspec.Struct, frozen=True):
    """Caps on a snapshot's size; the frontend sends them with each XrayCall."""

    max_requests: int = 256  # listed per queue (the counts are always exact)
    max_block_ids: int = 4096  # block ids listed across all listed requests
    max_map_cells: int = 8192  # block map cells; a bigger pool shares cells
    max_tree_nodes: int = 512
    num_eviction_head: int = 64


class XrayConfig(msgspec.Struct):
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    enable_prefix_caching: bool
    # The KV-cache groups, e.g. ["full: layers 5, 11", "sliding_window=512: layers 0, 1"];
    # one entry for a model with one kind of attention. Block map and prefix tree show
    # the one pool; the prefix tree group 0's chains.
    kv_cache_groups: list[str] = []


class XrayRequest(msgspec.Struct, omit_defaults=True):
    """One running or waiting request. `block_runs` are its blocks in token order as
    `[first_block_id, count]` runs of consecutive ids; their total falls short of
    `num_blocks` when the snapshot's `max_block_ids` ran out."""

    req_id: str
    status: str  # "running" | "waiting" | "preempted" (waiting again after a preemption)
    priority: int
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in its blocks
    num_output_tokens: int
    max_tokens: int
    num_cached_tokens: int  # prefix-cache hit when first scheduled (0 before that)
    num_blocks: int  # KV group 0's
    num_preemptions: int
    age_s: float  # since arrival
    block_runs: list[tuple[int, int]]  # KV group 0's
    # Speculative decoding: draft tokens it verified, and how many the model accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Several KV groups (sliding-window models): blocks held in each group, nulls of a
    # sliding window not counted; absent for one group.
    num_blocks_by_group: list[int] | None = None
    # A pooling request (embeddings, scores): prefill only, it pools instead of sampling.
    pooling: bool = False
    # Its images (vision models): how many, and their placeholder tokens in the prompt.
    num_images: int = 0
    num_image_tokens: int = 0
    # The LoRA adapter it runs under (--enable-lora); absent for the base model.
    lora_name: str | None = None
    # The API that sent it ("openai_chat", "anthropic_messages", ...: server/common/api_label.py),
    # filled by the frontend from the request id; absent for ids no API route made.
    api: str | None = None
    # Only with --xray-show-text (filled by the frontend, never by the core; absent otherwise).
    prompt_text: str | None = None
    output_text: str | None = None


class XrayBlockMap(msgspec.Struct):
    """Every block, by id, as runs of `(kind, ref_cnt, num_cells)`; kind 0 = free, 1 = free
    but cached (its KV still serves prefix hits), 2 = in use. A cell is `cell_size` blocks
    (1 unless the pool has more than `max_map_cells` blocks); a shared cell shows its
    highest kind and ref count. `eviction_head` is the free queue from its head: the
    blocks the next allocations take, evicting their cached KV."""

    num_blocks: int
    num_in_use: int
    num_free: int
    num_free_cached: int
    num_cached: int  # blocks holding a prefix-cache hash, in use or free
    cell_size: int
    runs: list[tuple[int, int, int]]
    eviction_head: list[int]


class XrayTreeNode(msgspec.Struct):
    """A cached block in the prefix tree; `parent` indexes `XrayPrefixTree.nodes`."""

    block_id: int
    hash: str  # the first HASH_HEX_DIGITS hex digits
    parent: int  # -1: the first block of a prompt
    ref_cnt: int  # requests holding it now
    num_hits: int  # admissions whose prefix-cache hit covered this block
    num_blocks_below: int  # cached blocks in its subtree, itself included (listed or not)


class XrayPrefixTree(msgspec.Struct):
    """The cached blocks as a tree of hash chains: a shared prefix is one trunk.

    `nodes` lists parents before children, biggest subtrees first, at most
    `max_tree_nodes`. Cached blocks outside the rooted tree are only counted: `detached`
    ones (and their subtrees) lost their parent to eviction, so no request can hit them
    until that parent is computed again; `unattached` ones have a parent the core never
    saw (generated tokens of a request that finished, with RECENT_CHAINS others, between
    two snapshots)."""

    nodes: list[XrayTreeNode]
    num_cached_blocks: int
    num_roots: int
    num_in_tree: int  # cached blocks under the roots, listed or not
    num_detached: int
    num_unattached: int


class XraySteps(msgspec.Struct):
    """The last steps, oldest first, as parallel lists (one entry per step).

    `num_prefill_tokens` are prompt tokens computed; `num_decode_tokens` the rest (one per
    decoding request, more for one recomputing its output after a preemption)."""

    step: list[int]
    end_time: list[float]
    duration_ms: list[float]
    num_reqs: list[int]
    num_prefill_tokens: list[int]
    num_decode_tokens: list[int]
    num_admitted: list[int]  # new or resumed after a preemption
    num_preemptions: list[int]
    num_finished: list[int]
    num_running: list[int]  # after the step
    num_waiting: list[int]
    num_images_encoded: list[int] = []  # images the vision encoder ran in the step


class XrayEncoderCache(msgspec.Struct):
    """The vision encoder's outputs kept between steps (engine/sched/encoder_cache.py)."""

    capacity: int  # embedding rows (--encoder-cache-size)
    num_used: int  # rows held
    num_entries: int  # images held
    num_in_use: int  # images some request still needs (the rest are freeable)


class XraySnapshot(msgspec.Struct):
    schema_version: int
    seq: int  # the core's snapshot counter
    taken_at: float  # time.time() in the core
    build_ms: float  # what building it cost the core (CPU time of its thread)
    num_steps: int
    config: XrayConfig
    num_running: int
    num_waiting: int
    running: list[XrayRequest]  # schedule order
    waiting: list[XrayRequest]  # queue order (the next admitted first)
    blocks: XrayBlockMap
    prefix_tree: XrayPrefixTree
    steps: XraySteps
    # Vision models only (None: a text model, or no image seen yet).
    encoder_cache: XrayEncoderCache | None = None
    # Filled by the frontend (server/http/xray.py), not by the core.
    model: str = ""
    show_text: bool = False
    min_interval_s: float = 0.0
