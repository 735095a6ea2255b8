"""KV-cache manager test helpers: requests whose tokens are characters, 4-token blocks.

Shared by tests/unit/kv_cache/.
"""

from __future__ import annotations

from engine.kv_cache.block_hash import BlockHasher, get_hash_fn
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
SHA256 = get_hash_fn("sha256")
HASHER = BlockHasher(BLOCK_SIZE, SHA256)


def tokens_of(text: str) -> list[int]:
    """One token per character: the walkthrough's example, as token ids."""
    return [ord(char) for char in text]


def make_request(req_id: str, prompt: list[int] | str, cache_salt: str | None = None,
                 **params) -> Request:
    if isinstance(prompt, str):
        prompt = tokens_of(prompt)
    return Request(req_id, prompt, SamplingParams(**params), cache_salt=cache_salt,
                   block_hasher=HASHER)
