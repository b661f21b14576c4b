"""Chained hashes of full KV blocks: the keys of the prefix cache.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so equal hashes
mean equal prefixes. The router computes the same hashes to find the worker that already holds a prompt's
prefix; both sides must agree bit for bit across processes and machines, so this uses blake2b over
little-endian token bytes rather than Python's `hash()`. A request's cache salt (`salt_root`) stands in as
the first block's parent, so salted prompts have chains of their own. No torch here: the router imports this module.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def salt_root(cache_salt: str) -> BlockHash | None:
    """The parent of a prompt's first block under `cache_salt` (None: no salt, the plain chain). Every block's
    hash chains from it, so prompts under different salts share no block hash, hence no cached block."""
    if not cache_salt:
        return None
    h = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"pdserve-salt")
    return int.from_bytes(h.digest(), "little", signed=True)


def hash_blocks(token_ids: Sequence[int], block_size: int, start: int = 0,
                parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start`; `parent` is block start-1's hash."""
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
