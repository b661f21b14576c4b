"""The router's picture of every worker's prefix cache: which chained block hashes each one holds.

Kept up to date from each worker's numbered change log (`engine.block_allocator.CacheEventLog`: hashes that
entered and left its cache), read from this index's own cursor per worker, and forgotten when a worker
leaves. Several router replicas each keep one, reading the same logs at their own pace. It can lag the
workers by one read; placement only uses it as a hint, the worker's own `find_cached` decides what is really
reused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from engine.block_allocator import CacheEvents
from protocol.block_hash import BlockHash
from protocol.messages import LoadReport


class PrefixIndex:
    def __init__(self) -> None:
        self._by_worker: dict[str, set[BlockHash]] = {}
        # NOTE: the inverse map lets `match_all` walk a prompt's hashes once for every worker together,
        # narrowing the candidates at each block, instead of once per worker.
        self._holders: dict[BlockHash, set[str]] = {}
        self._seq: dict[str, int] = {}  # by worker: the last change of its log folded in

    def cursor(self, worker_id: str) -> int:
        """The number of the worker's last cache change folded in; -1 when none was (read the whole cache)."""
        return self._seq.get(worker_id, -1)

    def apply_changes(self, worker_id: str, changes: CacheEvents | LoadReport) -> str:
        """Fold in the changes numbered `changes.since` < n <= `changes.seq`, exactly once and in order:

        - "applied": they start at the cursor;
        - "resynced": a full snapshot replaced the picture (the reader had fallen behind the log);
        - "stale": nothing newer than the cursor;
        - "behind": newer changes exist that these do not start at the cursor for (changes made after a
          read; a read overlapping one already applied): read again from `cursor`.
        """
        cursor = self.cursor(worker_id)
        if changes.seq <= cursor:
            return "stale"
        if changes.full:
            self.remove_worker(worker_id)
            self.apply(worker_id, changes.stored, [])
            self._seq[worker_id] = changes.seq
            return "resynced"
        if changes.since != cursor:
            return "behind"
        self.apply(worker_id, changes.stored, changes.removed)
        self._seq[worker_id] = changes.seq
        return "applied"

    def apply(self, worker_id: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """Fold one drain of a worker's cache events into the index.

        The two lists lose the order between stores and removals, and one drain can hold both for the same
        hash (stored, evicted, stored again). The allocator only stores a hash that is not cached and only
        removes one that is, so a hash's stores and removals alternate, and its net count (stores minus
        removals) says where it ends: +1 cached, -1 gone, 0 as it was.
        """
        blocks = self._by_worker.setdefault(worker_id, set())
        net = Counter(stored)
        net.subtract(removed)
        for h, n in net.items():
            if n > 0 and h not in blocks:
                blocks.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
            elif n < 0 and h in blocks:
                blocks.discard(h)
                self._drop_holder(h, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (it died, left, or reset its cache)."""
        self._seq.pop(worker_id, None)
        for h in self._by_worker.pop(worker_id, set()):
            self._drop_holder(h, worker_id)

    def match(self, worker_id: str, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` the worker holds (it reuses a prefix only up to the first miss)."""
        blocks = self._by_worker.get(worker_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def match_all(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """`match` for every worker at once: worker id -> leading hashes held, for workers holding >= 1."""
        result: dict[str, int] = {}
        candidates: set[str] = set()  # workers holding every hash before index n
        for n, h in enumerate(hashes):
            holders = self._holders.get(h, set())
            still = set(holders) if n == 0 else candidates & holders
            for worker in candidates - still:
                result[worker] = n
            candidates = still
            if not candidates:
                return result
        for worker in candidates:
            result[worker] = len(hashes)
        return result

    def num_blocks(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def blocks(self, worker_id: str) -> frozenset[BlockHash]:
        """A copy of the hashes the index believes the worker holds (for tests and debugging)."""
        return frozenset(self._by_worker.get(worker_id, ()))

    @property
    def workers(self) -> list[str]:
        return sorted(self._by_worker)

    def _drop_holder(self, h: BlockHash, worker_id: str) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]
