"""The router's workers: one `Worker` per actor, and the `WorkerRegistry` that holds every one the deployment
has had.

A `Worker` is the router's view of one actor: its client, what it said about itself at start (`WorkerInfo`),
its last load snapshot (`WorkerLoad`, what placement weighs) and the router's own counts for it. A worker
leaves the registry's live set exactly once, through `WorkerRegistry.lose`, whoever noticed first: its step
stream ending, a call finding its actor dead, or the liveness watch (`router.pool.PoolManager`) declaring it dead.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import PoolKind
from protocol.messages import LoadReport, WorkerInfo
from router.placement import WorkerLoad
from router.worker_client import WorkerClient

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # one object per worker: compared and hashed by identity
class Worker:
    info: WorkerInfo
    client: WorkerClient
    load: WorkerLoad
    inflight_prefill_tokens: int = 0  # prompt tokens sent to it and not yet answered (router's own count)
    promised_blocks: int = 0  # a decode worker's blocks counted for prompts whose reservation comes later
    draining: bool = False  # being taken out of service: placement skips it; it leaves once it holds nothing
    moved: collections.Counter = field(default_factory=collections.Counter)  # sequences drained off, by Method
    # a read of this worker's newer prefix-cache changes in flight, if any (`Router.apply_report`)
    cache_read: asyncio.Task | None = field(default=None, repr=False)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def kind(self) -> PoolKind:
        return self.load.pool

    @property
    def alive(self) -> bool:
        return self.load.alive

    def snapshot(self) -> WorkerLoad:
        """The load placement sees: the worker's report, plus prompts the router sent it since."""
        return dataclasses.replace(
            self.load, queued_prefill_tokens=max(self.load.queued_prefill_tokens, self.inflight_prefill_tokens))

    def apply(self, report: LoadReport) -> None:
        ld = report.load
        self.load = dataclasses.replace(
            self.load, num_running=ld.num_running, num_waiting=ld.num_waiting,
            queued_prefill_tokens=ld.queued_prefill_tokens, free_blocks=min(ld.free_blocks, ld.total_blocks),
            total_blocks=ld.total_blocks)


def make_worker(info: WorkerInfo, client: WorkerClient) -> Worker:
    """The router's view of a started worker, in the pool its `info.kind` names."""
    return Worker(info, client, WorkerLoad(info.worker_id, info.node_id, info.kind, free_blocks=info.num_blocks,
                                           total_blocks=info.num_blocks))


class WorkerRegistry:
    """Every worker the deployment has had, by id; `lose` is the one way out of the live set."""

    def __init__(self, kill_on_loss: bool = True) -> None:
        """`kill_on_loss`: losing a worker kills it. A router replica that is not the lead only stops using a
        worker it lost touch with: the workers are shared, and whether one is dead is the lead's call."""
        self.workers: dict[str, Worker] = {}
        self.kill_on_loss = kill_on_loss
        self.on_added: list[Callable[[Worker], None]] = []
        self.on_lost: list[Callable[[Worker, str], None]] = []

    def add(self, worker: Worker) -> None:
        old = self.workers.get(worker.worker_id)
        assert old is None or (not old.alive and not self.kill_on_loss), f"worker id {worker.worker_id} reused"
        self.workers[worker.worker_id] = worker
        for cb in self.on_added:
            cb(worker)

    def lose(self, worker: Worker, why: str) -> bool:
        """Kill the worker (a no-op if it is already dead; a stuck or cut-off one must do no more harm and
        must free its node's resources for a replacement), mark it dead and tell every listener, once.
        False if it was already lost."""
        if not worker.alive:
            return False
        logger.log(logging.INFO if worker.draining else logging.ERROR, "worker %s on node %s %s: %s",
                   worker.worker_id, worker.info.node_ip, "retired" if worker.draining else "lost", why)
        if self.kill_on_loss:
            try:
                worker.client.kill()
            except Exception as e:  # noqa: BLE001 - already gone is fine; it is lost either way
                logger.warning("killing %s: %s", worker.worker_id, e)
        worker.load = dataclasses.replace(worker.load, alive=False)
        for cb in self.on_lost:
            cb(worker, why)
        return True

    def live(self, kind: PoolKind | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive and (kind is None or w.kind is kind)]

    def schedulable(self, kind: PoolKind | None = None) -> list[Worker]:
        """Live workers that take new work: not draining."""
        return [w for w in self.live(kind) if not w.draining]

    def get(self, worker_id: str) -> Worker:
        return self.workers[worker_id]
