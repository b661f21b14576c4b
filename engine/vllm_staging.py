"""The staging cache of a vLLM decode worker: where KV from a prefill worker lands before vLLM holds it.

vLLM allocates a request's blocks only when it schedules the request, but a decode worker must name its
destination blocks before the prompt is computed elsewhere. So a reservation is blocks of this cache, in
pdserve's shape [layers, 2, blocks, block_size, kv_heads, head_dim], holding blocks in vLLM's byte order (as
the sender read them from vLLM's cache, `engine.vllm_layout`); once vLLM has allocated the request's own
blocks, `take` hands them to the connector, which copies them across whole, and the staging blocks go back.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache, KVCacheSpec
from engine.vllm_layout import tokens_of


class StagingCache:
    """Blocks reserved per request (by pdserve id) until their KV is loaded into vLLM or the request ends."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        self.cache = KVCache(spec, num_blocks, device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._staged: dict[str, list[int]] = {}  # request id -> its staging blocks, in prompt order

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return sum(len(b) for b in self._staged.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._staged

    def reserve(self, request_id: str, n: int) -> list[int] | None:
        """`n` blocks for `request_id`; None when fewer are free."""
        if n > len(self._free):
            return None
        blocks = self._staged[request_id] = [self._free.pop() for _ in range(n)]
        return blocks

    def release(self, request_id: str) -> None:
        """Give a request's blocks back (a no-op when it holds none)."""
        self._free.extend(self._staged.pop(request_id, ()))

    def tokens(self, request_id: str, num_tokens: int, start: int = 0) -> torch.Tensor | None:
        """K and V of the request's positions `start` to `num_tokens` as landed here, pdserve's layout."""
        staged = self._staged.get(request_id)
        return None if staged is None else tokens_of(self.cache.tensor, staged, num_tokens, start)

    def take(self, request_id: str, first_block: int, n: int) -> torch.Tensor:
        """The request's `n` staged blocks from prompt block `first_block` on (a copy, [layers, 2, n,
        block_size, kv_heads, head_dim], vLLM's byte order, for vLLM's cache); its blocks all go back."""
        staged = self._staged[request_id][first_block:first_block + n]
        index = torch.tensor(staged, dtype=torch.int64, device=self.cache.device)
        kv = self.cache.tensor.index_select(2, index)
        self.release(request_id)
        return kv
