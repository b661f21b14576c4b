"""The router's prefix index follows each worker's numbered cache-change log from its own cursor (what lets
several router replicas read one worker): it folds each change in once, reads again when a report says the
log moved past it, and resyncs from a full snapshot when the log no longer reaches its cursor."""

from __future__ import annotations

import asyncio

from engine.block_allocator import BlockAllocator, CacheEventLog
from protocol.messages import EngineLoad, LoadReport
from router.observer import RequestObserver
from tests.router.fakes import FakeCluster


class Resyncs(RequestObserver):
    def __init__(self) -> None:
        self.workers: list[str] = []

    def on_cache_resync(self, worker) -> None:
        self.workers.append(worker.worker_id)


def _cluster(capacity: int = 1 << 16) -> tuple[FakeCluster, BlockAllocator, Resyncs]:
    cluster = FakeCluster(num_prefill=1, num_decode=1)
    cluster.router.observer = observer = Resyncs()
    cache = cluster["prefill-0"].cache = BlockAllocator(num_blocks=8)
    cache.events = CacheEventLog(capacity)
    return cluster, cache, observer


def _store(cache: BlockAllocator, hashes: list[int]) -> list[int]:
    blocks = cache.allocate(len(hashes))
    for b, h in zip(blocks, hashes):
        cache.cache_block(b, h)
    return blocks


async def _report(cluster: FakeCluster, since: int) -> None:
    worker = cluster.registry.get("prefill-0")
    cluster.router.apply_report(worker, await worker.client.report(since, 1.0))
    await cluster.settle()


def test_a_report_that_only_says_the_log_moved_makes_the_router_read_from_its_cursor():
    async def main():
        cluster, cache, observer = _cluster()
        router, worker = cluster.router, cluster.registry.get("prefill-0")
        await _report(cluster, router.cache_cursor(worker))  # the first read: the whole (empty) cache
        assert router.cache_cursor(worker) == 0
        _store(cache, [11, 12, 13])
        # what a prefill's answer carries: the load and how far the log has got, not the changes
        router.apply_report(worker, LoadReport("prefill-0", EngineLoad(0, 0, 0, 8, 8, 3), since=3, seq=3))
        await cluster.settle()
        assert router.index.blocks("prefill-0") == {11, 12, 13} and router.cache_cursor(worker) == 3
        # a report overlapping what was read (store 11, 12, 13, then evict 11) is not folded in: netted, its
        # store and eviction of 11 would cancel and leave 11 in the index; the router reads from its cursor
        cache.free(cache.find_cached([11]))
        cache.allocate(6)  # evicts 11 (the only free cached block)
        overlapping = await worker.client.report(0, 1.0)
        assert (overlapping.since, overlapping.seq) == (0, 4)
        router.apply_report(worker, overlapping)
        await cluster.settle()
        assert router.index.blocks("prefill-0") == {12, 13} and router.cache_cursor(worker) == 4
        assert observer.workers == []

    asyncio.run(main())


def test_a_router_the_log_no_longer_reaches_is_resynced_from_the_whole_cache():
    async def main():
        cluster, cache, observer = _cluster(capacity=2)
        router, worker = cluster.router, cluster.registry.get("prefill-0")
        await _report(cluster, -1)
        _store(cache, [21])
        await _report(cluster, router.cache_cursor(worker))
        _store(cache, [22, 23, 24])  # three changes past the cursor; the log keeps two
        await _report(cluster, router.cache_cursor(worker))
        assert router.index.blocks("prefill-0") == {21, 22, 23, 24} and router.cache_cursor(worker) == 4
        assert observer.workers == ["prefill-0"]

    asyncio.run(main())
