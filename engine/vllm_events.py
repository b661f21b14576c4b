"""vLLM's KV cache events as pdserve's prefix-cache changes, for the router's prefix index.

vLLM's scheduler publishes `BlockStored`, `BlockRemoved` and `AllBlocksCleared` from its `step`, on the engine
loop's thread; `VllmCacheEvents` stands in for its publisher (no ZMQ) and hashes each stored block into
pdserve's chained block hash from its token ids, so a vLLM worker's cache is indexed as any other's.
"""

from __future__ import annotations

from typing import Any

from engine.block_allocator import CacheEventLog
from protocol.block_hash import BlockHash, hash_block


class VllmCacheEvents:
    """vLLM's event publisher interface (`publish`), keeping pdserve's hashes of every cached block."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.log = CacheEventLog()
        self.hashes: dict[Any, BlockHash] = {}  # vLLM's block hash -> pdserve's, for every cached block

    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        bs = self.block_size
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = self.hashes.get(event.parent_block_hash) if event.parent_block_hash is not None else None
                for i, vllm_hash in enumerate(event.block_hashes):
                    parent = hash_block(parent, event.token_ids[i * bs:(i + 1) * bs])
                    if vllm_hash not in self.hashes:
                        self.hashes[vllm_hash] = parent
                        self.log.append(parent, True)
            elif isinstance(event, BlockRemoved):
                for vllm_hash in event.block_hashes:
                    h = self.hashes.pop(vllm_hash, None)
                    if h is not None:
                        self.log.append(h, False)
            elif isinstance(event, AllBlocksCleared):
                for h in self.hashes.values():
                    self.log.append(h, False)
                self.hashes.clear()

    def shutdown(self) -> None:
        return None
