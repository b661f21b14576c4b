"""Which KV blocks each sequence holds (vLLM's `KVCacheManager`): the scheduler decides who runs, this decides
what blocks that takes.

A sequence's blocks are its `Request.block_ids`, in token order. New blocks come from the `BlockAllocator`;
a new sequence first takes whatever prefix of its prompt the prefix cache holds, and each block it fills is
registered in that cache under its hash (`commit_full_blocks`), so later prompts can share it. Everything a
sequence holds goes back in one call (`free`), on every path out: finished, aborted or preempted.
"""

from __future__ import annotations

import sys

from engine.block_allocator import BlockAllocator
from engine.config import cdiv
from engine.request import Request


class KVCacheManager:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._num_committed: dict[str, int] = {}  # request id -> leading blocks registered in the prefix cache

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole cache at all."""
        return cdiv(num_tokens, self.block_size) <= self.allocator.num_blocks

    def admit(self, req: Request, budget: int) -> bool:
        """Give a waiting request its blocks: the cached prefix first, then fresh ones for up to `budget` more
        tokens. Sets its computed (and, on first admission, cached) tokens; False, holding nothing, when the
        fresh blocks are not free."""
        bs = self.block_size
        # NOTE: at least the last prompt token is always computed, since its logits give the next token.
        cached = self.allocator.find_cached(req.block_hashes[:(req.num_tokens - 1) // bs])
        self.allocator.touch(cached)
        computed = len(cached) * bs
        n = min(req.num_tokens - computed, budget)
        fresh = self.allocator.allocate(cdiv(computed + n, bs) - len(cached))
        if fresh is None:
            self.allocator.free(cached)
            return False
        req.block_ids = cached + fresh
        req.num_computed_tokens = computed
        if not req.output_token_ids:  # first admission, not a recompute after preemption
            req.num_cached_tokens = computed
        self._num_committed[req.request_id] = len(cached)
        return True

    def reserve(self, req: Request) -> bool:
        """Blocks for a whole prompt whose KV another worker computes: the full blocks this cache already
        holds are reused (`req.num_cached_tokens` of them need not be sent), the rest are fresh. False, holding
        nothing, when out of room."""
        bs = self.block_size
        cached = self.allocator.find_cached(req.block_hashes[:req.num_prompt_tokens // bs])
        self.allocator.touch(cached)
        fresh = self.allocator.allocate(cdiv(req.num_prompt_tokens, bs) - len(cached))
        if fresh is None:
            self.allocator.free(cached)
            return False
        req.block_ids = cached + fresh
        req.num_cached_tokens = len(cached) * bs
        self._num_committed[req.request_id] = len(cached)
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Blocks for the sequence's first `num_tokens` tokens; False (holding what it had) when not free."""
        need = cdiv(num_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        req.block_ids += blocks
        return True

    def commit_full_blocks(self, req: Request) -> None:
        """Register the blocks the sequence's computed tokens fill in the prefix cache (each once)."""
        start = self._num_committed.get(req.request_id, 0)
        end = req.num_computed_tokens // self.block_size
        for i in range(start, end):
            self.allocator.cache_block(req.block_ids[i], req.block_hashes[i])
        self._num_committed[req.request_id] = max(start, end)

    def forget(self, req: Request, first_block: int) -> None:
        """Take the sequence's blocks from `first_block` on out of the prefix cache, and register none of its
        blocks again."""
        self.allocator.forget(req.block_ids[first_block:])
        self._num_committed[req.request_id] = sys.maxsize  # (as if every block were registered already)

    def trim(self, req: Request) -> None:
        """Free the blocks past the sequence's tokens (they held only rejected drafts' slots)."""
        keep = cdiv(req.num_tokens, self.block_size)
        if len(req.block_ids) > keep:
            self.allocator.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def free(self, req: Request) -> None:
        """Everything the sequence holds goes back (cached blocks stay in the prefix cache, evictable)."""
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        self._num_committed.pop(req.request_id, None)
