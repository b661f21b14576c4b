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


async def start_workers(specs: list[PoolSpec], kv_config: Any, name_prefix: str = "") -> list[Worker]:
    """Start every pool's actors and wait until each has loaded its model (startup progress on stderr)."""
    import ray

    from decode_worker import DecodeWorker
    from prefill_worker import PrefillWorker

    actors = []
    for spec in specs:
        cls = PrefillWorker if spec.kind is PoolKind.PREFILL else DecodeWorker
        remote_cls = ray.remote(cls).options(**spec.actor_options())
        for i in range(spec.num_workers):
            worker_id = f"{name_prefix}{spec.kind.value}-{i}"
            kv = None if spec.kind is PoolKind.COLOCATED else kv_config
            actors.append((spec.kind, remote_cls.remote(worker_id, spec.engine, kv)))
    workers = []
    for n, (kind, actor) in enumerate(actors, 1):
        info: WorkerInfo = await actor.info.remote()
        logger.info("worker %s ready on node %s (%d/%d)", info.worker_id, info.node_ip, n, len(actors))
        workers.append(Worker(info, actor, WorkerLoad(info.worker_id, info.node_id, kind,
                                                      free_blocks=info.num_blocks, total_blocks=info.num_blocks)))
    return workers


async def refresh_loads(workers: list[Worker], on_report, interval_s: float = 0.5) -> None:
    """Poll every live worker's load forever (placement also learns from each reply and step)."""
    import ray

    while True:
        live = [w for w in workers if w.alive]
        results = await asyncio.gather(*(w.actor.report.remote() for w in live), return_exceptions=True)
        for w, r in zip(live, results):
            if isinstance(r, ray.exceptions.RayActorError):
                logger.error("worker %s died: %s", w.worker_id, r)
                w.mark_dead()
            elif isinstance(r, LoadReport):
                on_report(w, r)
        await asyncio.sleep(interval_s)
