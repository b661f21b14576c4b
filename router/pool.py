"""The worker pools on Ray: starting the actors, and the router's live view of each worker.

Each worker is a Ray actor with one model replica, placed by its pool's resources (`{"CPU": 1}` here,
`{"GPU": 1}` on a GPU cluster, or custom node resources). The router keeps a `Worker` per actor: its
handle, what it said about itself at start (`WorkerInfo`) and its last load snapshot (`WorkerLoad`, what
placement weighs), refreshed from every message the worker sends and by a periodic poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.worker_types import LoadReport, WorkerInfo
from router.placement import PoolKind, WorkerLoad

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSpec:
    """How many workers of one kind, and what each one asks Ray for."""

    kind: PoolKind
    num_workers: int
    engine: EngineConfig  # each worker's model replica (prefill pools may take a larger token budget)
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"{self.kind.value} pool: num_workers must be >= 0, got {self.num_workers}")

    def actor_options(self) -> dict[str, Any]:
        r = dict(self.resources)
        return {"num_cpus": r.pop("CPU", 0), "num_gpus": r.pop("GPU", 0), "resources": r or None,
                "max_concurrency": 10_000, "max_restarts": 0}


@dataclass
class Worker:
    info: WorkerInfo
    actor: Any  # ray.actor.ActorHandle
    load: WorkerLoad
    inflight_prefill_tokens: int = 0  # prompt tokens sent to it and not yet answered (router's own count)

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

    def mark_dead(self) -> None:
        self.load = dataclasses.replace(self.load, alive=False)


class PoolManager:
    """Keeps each pool at its target size: starts the workers, notices lost ones, starts replacements.

    A worker whose actor dies (its node left, it crashed) is reported through `on_lost` and replaced as soon
    as Ray can place a new actor with the pool's resources: a node joining lets the pool grow back.
    Replacements Ray cannot place yet stay pending (one per missing worker), never piling up.
    """

    def __init__(self, specs: list[PoolSpec], kv_config: Any, on_ready: Callable[[Worker], None],
                 on_lost: Callable[[Worker], None], on_report: Callable[[Worker, LoadReport], None]) -> None:
        self.specs = specs
        self.kv_config = kv_config
        self.on_ready, self.on_lost, self.on_report = on_ready, on_lost, on_report
        self.workers: dict[str, Worker] = {}
        self.pending: dict[PoolKind, int] = {spec.kind: 0 for spec in specs}
        self._next_index: dict[PoolKind, int] = {spec.kind: 0 for spec in specs}
        self._tasks: set[asyncio.Task] = set()

    def live(self, kind: PoolKind | None = None) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive and (kind is None or w.kind is kind)]

    async def start(self) -> None:
        """Start every pool's workers and wait until each has loaded its model."""
        starts = [self._start_one(spec) for spec in self.specs for _ in range(spec.num_workers)]
        total = len(starts)
        for n, fut in enumerate(asyncio.as_completed(starts), 1):
            worker = await fut
            logger.info("worker %s ready on node %s (%d/%d)", worker.worker_id, worker.info.node_ip, n, total)

    async def maintain(self, interval_s: float = 0.5) -> None:
        """Forever: refresh every live worker's load, retire dead ones, top pools back up."""
        import ray

        while True:
            live = self.live()
            results = await asyncio.gather(*(w.actor.report.remote() for w in live), return_exceptions=True)
            for w, r in zip(live, results):
                if isinstance(r, ray.exceptions.RayActorError):
                    self.lose(w, str(r))
                elif isinstance(r, LoadReport):
                    self.on_report(w, r)
            for spec in self.specs:
                for _ in range(spec.num_workers - len(self.live(spec.kind)) - self.pending[spec.kind]):
                    task = asyncio.ensure_future(self._start_one(spec))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(interval_s)

    def lose(self, worker: Worker, why: str) -> None:
        if worker.alive:
            logger.error("worker %s on node %s lost: %s", worker.worker_id, worker.info.node_ip, why)
            worker.mark_dead()
            self.on_lost(worker)

    async def _start_one(self, spec: PoolSpec) -> Worker:
        import ray

        from decode_worker import DecodeWorker
        from prefill_worker import PrefillWorker

        cls = PrefillWorker if spec.kind is PoolKind.PREFILL else DecodeWorker
        worker_id = f"{spec.kind.value}-{self._next_index[spec.kind]}"
        self._next_index[spec.kind] += 1
        kv = None if spec.kind is PoolKind.COLOCATED else self.kv_config
        actor = ray.remote(cls).options(**spec.actor_options()).remote(worker_id, spec.engine, kv)
        self.pending[spec.kind] += 1
        try:
            info: WorkerInfo = await actor.info.remote()
        finally:
            self.pending[spec.kind] -= 1
        worker = Worker(info, actor, WorkerLoad(info.worker_id, info.node_id, spec.kind,
                                                free_blocks=info.num_blocks, total_blocks=info.num_blocks))
        self.workers[worker_id] = worker
        self.on_ready(worker)
        return worker
