"""Operating the pools at run time: scale a pool, drain a worker, roll a pool to new workers.

What an operator does to a live deployment, with no request noticing:
- **drain** a worker: placement skips it at once; prompts it prefills finish; sequences it decodes move to
  another decode worker with their KV (`Router.drain_worker`); then it is shut down and retired. The pool
  shrinks by one, or, with `replace`, a new worker takes its place.
- **scale** a pool to N: up, the pool manager starts workers, each taking traffic the moment it is ready;
  down, the least-loaded workers are drained and retired.
- **restart** a pool (a rolling restart): for each of its workers in turn, a new one is started first
  (the pool briefly runs one over its target), then the old one is drained, so capacity never dips.

One change per pool at a time (a second is refused with ABORTED); changes to different pools may overlap.
Errors are `AdminError`s carrying the gRPC status the admin servicer answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from protocol import Method, PoolKind
from router.pool import PoolManager
from router.registry import Worker
from router.router import Router

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0


class AdminError(Exception):
    """A refused operation; `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class DrainOutcome:
    worker_id: str
    moved: dict[Method, int] = field(default_factory=dict)  # sequences moved off it, by method
    clean: bool = True  # False: the timeout passed with requests on it (they failed over by recompute)
    replacement: str = ""  # the worker started in its place
    seconds: float = 0.0
    blocks_held_at_exit: int | None = None  # KV blocks its requests still held when it stopped (0 if clean)


@dataclass
class PoolSize:
    pool: PoolKind
    target: int
    serving: int
    draining: int
    starting: int


@dataclass
class ScaleOutcome:
    pool: PoolSize
    started: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)


class PoolAdmin:
    def __init__(self, router: Router, pools: PoolManager) -> None:
        self.router = router
        self.pools = pools
        self.registry = pools.registry
        self._busy: set[PoolKind] = set()
        # with router replicas (`control.replica_set.ReplicaSet.drain_worker`): the other replicas drain their own
        # requests off a worker while this router drains its own; True when they all finished in time
        self.drain_elsewhere: Callable[[Worker, Method, float], Awaitable[bool]] | None = None

    # -- reading ----------------------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        return sorted(self.registry.live(), key=lambda w: (w.kind.value, _index(w.worker_id)))

    def size(self, kind: PoolKind) -> PoolSize:
        live = self.registry.live(kind)
        serving = sum(1 for w in live if not w.draining)
        return PoolSize(kind, self.pools.targets[kind], serving, len(live) - serving, self.pools.pending[kind])

    def sizes(self) -> list[PoolSize]:
        return [self.size(spec.kind) for spec in self.pools.specs]

    # -- changing ---------------------------------------------------------------------------------------

    async def scale(self, kind: PoolKind, num_workers: int, method: Method = Method.KV,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> ScaleOutcome:
        self._check_pool(kind)
        if num_workers < 1:
            raise AdminError("INVALID_ARGUMENT", f"num_workers: must be >= 1, got {num_workers} (a pool with no "
                             f"worker serves nothing; drain workers one by one to empty a node)")
        if num_workers > self.pools.max_workers:
            raise AdminError("INVALID_ARGUMENT", f"num_workers: at most {self.pools.max_workers} workers per pool, "
                             f"got {num_workers} (raise the cap with pdserve serve --max-pool-size)")
        async with self._changing(kind):
            before = {w.worker_id for w in self.registry.live(kind)}
            serving = self.registry.schedulable(kind)
            self.pools.targets[kind] = num_workers
            outcome = ScaleOutcome(self.size(kind))
            deadline = time.monotonic() + timeout_s
            if num_workers > len(serving):
                logger.info("scaling the %s pool up: %d -> %d", kind.value, len(serving), num_workers)
                await self._until(lambda: len(self.registry.schedulable(kind)) >= num_workers, deadline,
                                  f"the {kind.value} pool to reach {num_workers} ready workers")
            elif num_workers < len(serving):
                # least loaded first: fewest sequences, then most free blocks, then the newest
                victims = sorted(serving, key=lambda w: (w.load.num_running + w.load.num_waiting,
                                                          -w.load.free_blocks, -_index(w.worker_id)))
                victims = victims[:len(serving) - num_workers]
                logger.info("scaling the %s pool down: %d -> %d, draining %s", kind.value, len(serving),
                            num_workers, ", ".join(w.worker_id for w in victims))
                for w in victims:  # before the first await: none of them takes new work from here on
                    w.draining = True
                results = await asyncio.gather(*(self._drain_and_retire(w, method, deadline) for w in victims))
                outcome.retired = [r.worker_id for r in results]
            outcome.started = sorted({w.worker_id for w in self.registry.live(kind)} - before, key=_index)
            outcome.pool = self.size(kind)
            return outcome

    async def drain(self, worker_id: str, method: Method = Method.KV, replace: bool = False,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> DrainOutcome:
        worker = self.registry.workers.get(worker_id)
        if worker is None or not worker.alive:
            known = ", ".join(w.worker_id for w in self.workers())
            raise AdminError("NOT_FOUND", f"worker_id: no live worker {worker_id!r} (workers: {known})")
        async with self._changing(worker.kind):
            if worker.draining:
                raise AdminError("FAILED_PRECONDITION", f"{worker_id} is already draining")
            if not replace and self.registry.schedulable(worker.kind) == [worker]:
                raise AdminError("FAILED_PRECONDITION", f"{worker_id} is the last serving {worker.kind.value} "
                                 "worker: scale the pool up first, or drain it with replace (or restart the pool)")
            deadline = time.monotonic() + timeout_s
            if replace:
                return await self._replace(worker, method, deadline)
            self.pools.targets[worker.kind] -= 1
            worker.draining = True
            return await self._drain_and_retire(worker, method, deadline)

    async def restart(self, kind: PoolKind, method: Method = Method.KV,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> list[DrainOutcome]:
        """Replace every worker of the pool, one at a time, each through `drain` with a new one started first."""
        self._check_pool(kind)
        async with self._changing(kind):
            old = sorted(self.registry.schedulable(kind), key=lambda w: _index(w.worker_id))
            logger.info("rolling restart of the %s pool: %s", kind.value, ", ".join(w.worker_id for w in old))
            outcomes = []
            for worker in old:
                if worker.alive and not worker.draining:
                    outcomes.append(await self._replace(worker, method, time.monotonic() + timeout_s))
            return outcomes

    # -- steps ------------------------------------------------------------------------------------------

    async def _replace(self, worker: Worker, method: Method, deadline: float) -> DrainOutcome:
        """Start a new worker (surge: the pool runs one over target meanwhile), then drain the old one."""
        kind = worker.kind
        before = {w.worker_id for w in self.registry.live(kind)}
        want = len(self.registry.schedulable(kind)) + 1
        self.pools.targets[kind] += 1
        try:
            await self._until(lambda: len(self.registry.schedulable(kind)) >= want, deadline,
                              f"a new {kind.value} worker to replace {worker.worker_id}")
        except AdminError:
            self.pools.targets[kind] -= 1
            raise
        new = sorted({w.worker_id for w in self.registry.live(kind)} - before, key=_index)
        worker.draining = True  # before the target drops: the pool manager must not start another
        self.pools.targets[kind] -= 1
        outcome = await self._drain_and_retire(worker, method, deadline)
        outcome.replacement = new[-1] if new else ""
        return outcome

    async def _drain_and_retire(self, worker: Worker, method: Method, deadline: float) -> DrainOutcome:
        start = time.monotonic()
        timeout = max(0.0, deadline - start)
        if self.drain_elsewhere is None:
            clean = await self.router.drain_worker(worker, method, timeout)
        else:
            clean = all(await asyncio.gather(self.router.drain_worker(worker, method, timeout),
                                             self.drain_elsewhere(worker, method, timeout)))
        held = None
        with contextlib.suppress(Exception):  # lets it close its KV links politely; it is killed anyway
            load = await worker.client.shutdown(5.0)
            held = None if load is None else load.total_blocks - load.free_blocks
        why = "drained" if clean else "drain timed out: what it still held fails over by recompute"
        self.registry.lose(worker, why)
        logger.info("%s %s in %.1fs (moved: %s; blocks held at exit: %s)", worker.worker_id, why,
                    time.monotonic() - start, {m.value: n for m, n in worker.moved.items()}, held)
        return DrainOutcome(worker.worker_id, dict(worker.moved), clean, seconds=time.monotonic() - start,
                            blocks_held_at_exit=held)

    def _check_pool(self, kind: PoolKind) -> None:
        if kind not in self.pools.targets:
            have = ", ".join(k.value for k in self.pools.targets)
            raise AdminError("INVALID_ARGUMENT", f"pool: this deployment has no {kind.value} pool (it has: {have})")

    @contextlib.asynccontextmanager
    async def _changing(self, kind: PoolKind):
        if kind in self._busy:
            raise AdminError("ABORTED", f"another change to the {kind.value} pool is in progress; retry when it "
                             "has finished (pdserve workers shows it)")
        self._busy.add(kind)
        try:
            yield
        finally:
            self._busy.discard(kind)

    @staticmethod
    async def _until(predicate, deadline: float, what: str) -> None:
        while not predicate():
            if time.monotonic() > deadline:
                raise AdminError("DEADLINE_EXCEEDED", f"timed out waiting for {what}; the change goes on in the "
                                 "background (pdserve workers shows it)")
            await asyncio.sleep(0.05)


def _index(worker_id: str) -> int:
    """`decode-12` -> 12: workers sort by start order, not as strings."""
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1
