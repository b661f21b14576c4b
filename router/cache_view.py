"""What the router knows of each worker from its reports: its load, and its prefix cache in the index.

Every load report (periodic, on a prefill's answer, on a decode step) is folded in here; a report whose cache
changes do not start at this replica's cursor makes it read the worker's change log again from there.
"""

from __future__ import annotations

from protocol.messages import LoadReport
from router.registry import Worker
from router.shared import Shared
from router.worker_client import WorkerError

__all__ = ["CacheView"]


class CacheView:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.index = shared.index

    def apply_report(self, worker: Worker, report: LoadReport) -> None:
        if self._fold_report(worker, report) == "behind" and (worker.cache_read is None or worker.cache_read.done()):
            worker.cache_read = self.shared.background.spawn(self._read_cache_changes(worker))

    def _fold_report(self, worker: Worker, report: LoadReport) -> str | None:
        """Take a report's load and cache changes; the cache outcome (`PrefixIndex.apply_changes`), None when
        the report says nothing of the cache."""
        worker.apply(report)
        self.shared.observer.on_report(worker, report)
        self.shared.room.set()
        return self._apply_cache_changes(worker, report) if report.seq is not None else None

    def cache_cursor(self, worker: Worker) -> int:
        """Where the next read of the worker's prefix-cache changes starts (`PoolManager`'s reports)."""
        return self.index.cursor(worker.worker_id)

    def _apply_cache_changes(self, worker: Worker, report: LoadReport) -> str:
        """Fold a worker's prefix-cache changes into the index, in order and exactly once.

        NOTE: decode workers' caches too: a prompt whose prefix a decode worker holds may prefill there.
        Each router replica reads every worker's numbered change log from its own cursor
        (`PrefixIndex.apply_changes`). A prefill's answer carries the changes after the cursor the router had
        when it asked, so the prompt's blocks are in the index before the client's next request. A report that
        does not start at the cursor (other reports moved it meanwhile; a report that only says how far the
        log has got) makes the router read again from the cursor, and a reader the log could no longer serve
        gets the whole cache (a resync)."""
        had = self.index.cursor(worker.worker_id) >= 0
        outcome = self.index.apply_changes(worker.worker_id, report)
        if outcome == "resynced" and had:
            self.shared.observer.on_cache_resync(worker)
        return outcome

    async def _read_cache_changes(self, worker: Worker) -> None:
        for _ in range(3):  # another report may move the cursor meanwhile: read again from where it is now
            try:
                report = await worker.client.report(self.index.cursor(worker.worker_id),
                                                    self.shared.config.call_timeout_s)
            except WorkerError as e:
                if e.lost:
                    self.shared.registry.lose(worker, e.reason)
                return  # the next periodic report reads them
            if not worker.alive or self._fold_report(worker, report) != "behind":
                return

    def forget(self, worker: Worker) -> None:
        """A lost worker's cache is gone with it."""
        self.index.remove_worker(worker.worker_id)
