"""Reference-counted KV block allocator with prefix caching.

Every block is in exactly one of two places: *in use* (ref_count > 0, owned by one or more sequences) or the
*free queue* (ref_count == 0). A free block may still hold a cached full block of KV, keyed by its chained
hash (see `block_hash`): a later sequence with the same prefix takes it back with `touch`. Allocation pops the
least recently freed block and, if it was cached, evicts it from the cache (LRU eviction).

Running out of blocks is a normal outcome: `allocate` returns None and changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice

from protocol.block_hash import BlockHash

# prefix-cache changes kept for readers that lag (a router replica between two reports): beyond this, a
# reader gets the whole cache instead
EVENT_LOG_CAPACITY = 1 << 16


@dataclass
class CacheEvents:
    """The prefix-cache changes after sequence number `since` up to `seq` (for a router's index): block hashes
    that entered or left the cache. With `full`, `stored` is the whole cache as of `seq` instead: the changes
    the reader asked for were no longer kept."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    since: int = 0
    seq: int = 0
    full: bool = False


class CacheEventLog:
    """Every prefix-cache change, numbered from 1, the last `capacity` of them kept.

    NOTE: readers keep their own cursor (several router replicas read one worker's log, each at its own
    pace), so reading never consumes: a reader that missed changes asks again from its cursor, and one that
    fell further behind than the log reaches gets a full snapshot and resyncs."""

    def __init__(self, capacity: int = EVENT_LOG_CAPACITY) -> None:
        self.seq = 0  # the last change's number
        self._log: deque[tuple[BlockHash, bool]] = deque(maxlen=capacity)  # (hash, stored?)

    def append(self, block_hash: BlockHash, stored: bool) -> None:
        self.seq += 1
        self._log.append((block_hash, stored))

    def since(self, seq: int) -> list[tuple[BlockHash, bool]] | None:
        """The changes numbered after `seq`, oldest first; None when the log no longer holds them all (or
        `seq` is not one of its numbers)."""
        n = self.seq - seq
        if seq < 0 or n < 0 or n > len(self._log):
            return None
        return list(islice(self._log, len(self._log) - n, None))

    def changes(self, seq: int, cached: Iterable[BlockHash]) -> CacheEvents:
        """The changes after change number `seq`, or `cached` (every block the cache holds now) as a full
        snapshot when the log no longer holds them."""
        changes = self.since(seq)
        if changes is None:
            return CacheEvents(list(cached), [], seq, self.seq, full=True)
        return CacheEvents([h for h, stored in changes if stored], [h for h, stored in changes if not stored],
                           seq, self.seq)


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        # NOTE: an OrderedDict as an O(1) LRU queue: head = evicted first, and cached blocks can be taken
        # out of the middle when a new sequence reuses them.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.events = CacheEventLog()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out (including evictable cached ones)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks with ref_count 1, or None (and no change) when fewer than `n` are free."""
        if n > len(self.free_queue):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Tail blocks go to the queue first so they are evicted first."""
        for block in reversed(blocks):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def fork(self, blocks: list[int]) -> None:
        """Share in-use blocks with another owner (one more reference each)."""
        for block in blocks:
            assert self.ref_counts[block] > 0, f"fork of free block {block}"
            self.ref_counts[block] += 1

    def find_cached(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes`. Takes no reference (see `touch`)."""
        blocks = []
        if self.enable_caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks found by `find_cached`, pulling free ones out of the queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Register a full, computed, in-use block under its chained hash."""
        assert self.ref_counts[block] > 0, f"caching free block {block}"
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        if block_hash in self.cached:
            return  # the same prefix computed twice concurrently: keep the first copy cached
        self.block_hashes[block] = block_hash
        self.cached[block_hash] = block
        self.events.append(block_hash, True)

    def forget(self, blocks: list[int]) -> None:
        """Take blocks out of the prefix cache, whoever holds them: their KV is not to be reused (a transfer's
        check found it differs from what was sent)."""
        for block in blocks:
            self._evict(block)

    def reset_cache(self) -> None:
        """Forget every cached prefix whose block is free."""
        for block in list(self.free_queue):
            self._evict(block)

    def changes_since(self, seq: int) -> CacheEvents:
        """The cache changes after change number `seq` (-1: none seen yet), or the whole cache when the log
        no longer holds them."""
        return self.events.changes(seq, self.cached)

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            self.block_hashes[block] = None
            del self.cached[h]
            self.events.append(h, False)

    def check_invariants(self) -> None:
        """Assert the allocator's internal consistency (for tests and debugging)."""
        for block in range(self.num_blocks):
            in_queue = block in self.free_queue
            assert (self.ref_counts[block] == 0) == in_queue, f"block {block}: ref/free-queue mismatch"
            assert self.ref_counts[block] >= 0
        for h, block in self.cached.items():
            assert self.block_hashes[block] == h, f"cache map disagrees for block {block}"
        assert sum(h is not None for h in self.block_hashes) == len(self.cached)
