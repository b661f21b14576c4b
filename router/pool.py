"""The worker pools: a manager that starts, watches and replaces the workers of `router.registry`.

Each worker is a Ray actor with one model replica, placed by its pool's resources (`{"CPU": 1}` here,
`{"GPU": 1}` on a GPU cluster, or custom node resources).

Liveness (`PoolManager`): every `interval_s` each worker is pinged (answered by its actor thread) with a
`worker_timeout_s` deadline. No answer in time, or an engine loop that has not moved for `worker_timeout_s`
while it has work, and the worker is declared dead: killed (so it can do no more harm), lost, replaced.
A transient `ActorUnavailableError` is not death. Replacements that fail to start back off exponentially.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from protocol import PoolKind
from protocol.messages import CONTRACT, LoadReport, WorkerInfo
from router.background import Background
from router.registry import Worker, WorkerRegistry, make_worker
from router.worker_client import Failure, WorkerClient, WorkerError

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

    @property
    def worker_engine(self) -> EngineConfig:
        """Each worker's engine config: a fractional GPU (`{"GPU": 0.5}`) is the share of the device its KV
        cache is sized from, so the workers sharing a GPU split it evenly rather than by start order."""
        gpu = self.resources.get("GPU", 0)
        if not 0 < gpu < 1:
            return self.engine
        return dataclasses.replace(self.engine, cache=dataclasses.replace(self.engine.cache, device_share=gpu))

    def actor_options(self) -> dict[str, Any]:
        r = dict(self.resources)
        return {"num_cpus": r.pop("CPU", 0), "num_gpus": r.pop("GPU", 0), "resources": r or None,
                "max_concurrency": 10_000, "max_restarts": 0}


@dataclass(frozen=True)
class LivenessConfig:
    worker_timeout_s: float = 10.0  # no ping answer, or no engine progress while busy, this long: dead
    interval_s: float = 0.5  # how often each worker is pinged and its load refreshed
    backoff_initial_s: float = 0.5  # first wait after a replacement failed to start
    backoff_max_s: float = 30.0
    # a crash loop: this many workers of one pool in a row lost within `crash_window_s` of being ready; from
    # then on each replacement waits the same backoff as a failed start, until a worker outlives the window
    crash_window_s: float = 30.0
    crash_loop_after: int = 3

    def __post_init__(self) -> None:
        if self.worker_timeout_s <= 0:
            raise ValueError(f"--worker-timeout must be > 0 seconds, got {self.worker_timeout_s}")
        if not 0 < self.interval_s < self.worker_timeout_s:
            raise ValueError(f"liveness interval_s must be in (0, worker_timeout_s), got {self.interval_s}")


Launcher = Callable[[PoolSpec, str], Awaitable[WorkerClient]]


class PoolManager:
    """Keeps each pool at its target size: starts the workers, watches them, replaces lost ones.

    A lost worker (its node left, it crashed, it was declared dead) is replaced as soon as a new one can be
    placed: a node joining lets the pool grow back. Replacements not started yet stay pending (one per
    missing worker), never piling up; one that fails to start is retried after an exponential backoff. When a
    pool's target drops below what it runs and starts, the newest replacement starts are cancelled (their
    actors killed, even before a node could take them), so a start left over from a scale-up that outgrew
    the cluster cannot take the resources another pool's replacement needs.
    """

    def __init__(self, specs: list[PoolSpec], registry: WorkerRegistry, launch: Launcher,
                 liveness: LivenessConfig | None = None,
                 on_report: Callable[[Worker, LoadReport], None] = lambda w, r: None,
                 on_heartbeat: Callable[[Worker], None] = lambda w: None,
                 cache_cursor: Callable[[Worker], int] = lambda w: -1, follow: bool = False,
                 max_workers: int = 64) -> None:
        """`on_report` gets each worker's periodic load report, read from `cache_cursor(worker)` (the last
        prefix-cache change the router's index holds, see `Router.apply_report`).

        `follow`: the manager of a router replica that is not the lead (`control.follower`). The lead starts,
        replaces and declares dead every worker and tells it which workers there are (`adopt`; `lose`);
        this one only pings them (for its own leases' renewals) and reads their load.

        `max_workers`: the largest target a pool may be given (`PoolAdmin.scale` refuses more)."""
        self.specs = specs
        self.max_workers = max_workers
        self.registry = registry
        self.launch = launch
        self.liveness = liveness or LivenessConfig()
        self.on_report = on_report
        self.on_heartbeat = on_heartbeat
        self.cache_cursor = cache_cursor
        self.follow = follow
        # whether this manager may declare workers dead and start new ones right now: router replicas' lead
        # only while the replicas' mailbox confirms it leads (a lead that was stopped or cut off must not
        # act before it learns another replica took over)
        self.authority: Callable[[], bool] = lambda: True
        # how many schedulable workers each pool should have; `scale` changes it at run time
        self.targets: dict[PoolKind, int] = {spec.kind: spec.num_workers for spec in specs}
        self.pending: dict[PoolKind, int] = {spec.kind: 0 for spec in specs}
        # the replacement starts `maintain` made and that have not ended, oldest first (cancellable)
        self._starting: dict[PoolKind, list[asyncio.Task]] = {spec.kind: [] for spec in specs}
        self._next_index: dict[PoolKind, int] = {spec.kind: 0 for spec in specs}
        self._backoff: dict[PoolKind, float] = {spec.kind: 0.0 for spec in specs}
        self._retry_at: dict[PoolKind, float] = {spec.kind: 0.0 for spec in specs}
        self._quick_losses: dict[PoolKind, int] = {spec.kind: 0 for spec in specs}  # in a row (crash loop)
        self._young: dict[Worker, float] = {}  # when each worker it started was ready, until the crash window
        self._last_quick_loss: dict[PoolKind, float] = {spec.kind: -math.inf for spec in specs}
        registry.on_lost.append(self._lost)
        self._background = Background()
        self._stopping = False

    def live(self, kind: PoolKind | None = None) -> list[Worker]:
        return self.registry.live(kind)

    def spec(self, kind: PoolKind) -> PoolSpec:
        return next(s for s in self.specs if s.kind is kind)

    def backoff_left(self, kind: PoolKind) -> float:
        """Seconds before the pool may start its next replacement (0: at once)."""
        return max(0.0, self._retry_at[kind] - time.monotonic())

    async def start(self) -> None:
        """Start every pool's workers and wait until each has loaded its model."""
        starts = [asyncio.ensure_future(self._start_one(spec)) for spec in self.specs for _ in range(spec.num_workers)]
        try:
            for n, fut in enumerate(asyncio.as_completed(starts), 1):
                worker = await fut
                logger.info("worker %s ready on node %s (%d/%d)", worker.worker_id, worker.info.node_ip, n,
                            len(starts))
        except BaseException as e:
            # NOTE: the others run to their end, so every worker that did start is in the registry for the
            # caller's stop (none keeps running unknown); cancelled, they are cancelled too, and a start
            # cancelled kills its half-started worker (`_start_one`)
            if isinstance(e, asyncio.CancelledError):
                for fut in starts:
                    fut.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            raise

    async def maintain(self) -> None:
        """Forever: top pools up to their targets (with backoff after failed starts). A draining worker does
        not count: a rolling restart's replacement starts as soon as its predecessor begins draining."""
        while not self._stopping:
            now = time.monotonic()
            for spec in self.specs:
                starting = self._starting[spec.kind]
                starting[:] = [t for t in starting if not t.done()]
                missing = (self.targets[spec.kind] - len(self.registry.schedulable(spec.kind))
                           - self.pending[spec.kind])
                if missing > 0 and now >= self._retry_at[spec.kind] and self.authority():
                    for _ in range(missing):
                        starting.append(self._background.spawn(self._replace(spec)))
                elif missing < 0 and starting:  # the target dropped (scaled down) below what is coming
                    excess = starting[missing:]
                    del starting[missing:]
                    logger.info("%s pool: target %d, cancelling %d worker start(s) no longer needed",
                                spec.kind.value, self.targets[spec.kind], len(excess))
                    for task in excess:
                        task.cancel()
            await asyncio.sleep(self.liveness.interval_s)

    def adopt(self, info: WorkerInfo, client: WorkerClient) -> Worker:
        """A following manager: take on a worker the lead started (again while it is live: a no-op; after this
        replica lost touch with it: a fresh start)."""
        assert self.follow, "adopt() is for a following manager: the lead starts its own workers"
        known = self.registry.workers.get(info.worker_id)
        if known is not None and known.alive:
            return known
        worker = make_worker(info, client)
        self.registry.add(worker)
        self._background.spawn(self._watch(worker))
        return worker

    def promote(self, launch: Launcher, targets: dict[PoolKind, int]) -> None:
        """A following manager becomes the lead's (the lead died): from now on it declares workers dead and
        starts replacements with `launch`, keeping `targets` (the old lead's; call `maintain` next). New
        worker ids continue after every id this manager has seen."""
        self.follow = False
        self.launch = launch
        self.targets.update(targets)
        for worker_id in self.registry.workers:
            name, _, n = worker_id.rpartition("-")
            kind = next((k for k in self._next_index if k.value == name), None)
            if kind is not None and n.isdigit():
                self._next_index[kind] = max(self._next_index[kind], int(n) + 1)

    async def close(self) -> None:
        self._stopping = True
        await self._background.close()

    async def _replace(self, spec: PoolSpec) -> None:
        try:
            worker = await self._start_one(spec)
        except Exception as e:  # noqa: BLE001 - logged, retried after a backoff
            b = self._back_off(spec.kind)
            logger.error("replacement %s worker failed to start (%s); retrying in %.1fs", spec.kind.value, e, b)
            return
        logger.info("replacement worker %s ready on node %s", worker.worker_id, worker.info.node_ip)

    def _back_off(self, kind: PoolKind) -> float:
        """Hold the pool's next replacement back, twice as long as the last time (within the configured
        bounds); returns the wait."""
        cfg = self.liveness
        b = self._backoff[kind] = min(max(self._backoff[kind] * 2, cfg.backoff_initial_s), cfg.backoff_max_s)
        self._retry_at[kind] = time.monotonic() + b
        return b

    def _lost(self, worker: Worker, why: str) -> None:
        """(`WorkerRegistry.on_lost`) A worker this manager started was lost within the crash window of being
        ready, not retired: the pool is one loss nearer a crash loop, and in one its replacements back off.

        NOTE: a worker that dies soon after every start (a bad node, a driver fault, host memory) would
        otherwise be replaced in a loop as tight as a model load, each start loading the cluster and its
        logs. A single quick loss is not a loop (a chaos drill, a node lost under a fresh worker), so it
        takes `crash_loop_after` in a row; one worker outliving the window ends it (`_watch`). "In a row"
        means one start after another: workers that were already up when the last quick loss happened
        (a node lost under several of them) add nothing to it."""
        ready = self._young.pop(worker, None)
        kind, cfg, now = worker.kind, self.liveness, time.monotonic()
        if ready is None or worker.draining or self._stopping or now - ready > cfg.crash_window_s:
            return
        if ready <= self._last_quick_loss[kind]:  # the same failure as the last quick loss
            return
        self._last_quick_loss[kind] = now
        n = self._quick_losses[kind] = self._quick_losses[kind] + 1
        if n >= cfg.crash_loop_after:
            b = self._back_off(kind)
            logger.error("%s pool in a crash loop: %d workers in a row lost within %.0fs of being ready (the last, "
                         "%s: check its log); the next replacement waits %.1fs", kind.value, n, cfg.crash_window_s,
                         worker.worker_id, b)

    async def _start_one(self, spec: PoolSpec) -> Worker:
        worker_id = f"{spec.kind.value}-{self._next_index[spec.kind]}"
        self._next_index[spec.kind] += 1
        self.pending[spec.kind] += 1
        client = None
        try:
            client = await self.launch(spec, worker_id)
            info = await client.info()
            if info.contract != CONTRACT:
                raise RuntimeError(
                    f"worker {worker_id} runs other pdserve code than this router (protocol.messages "
                    f"{info.contract} against {CONTRACT}): a node with another image or version, or a checkout "
                    "changed under a running deployment. Run one build everywhere and restart the deployment")
            if info.kind != spec.kind:
                raise RuntimeError(f"worker {worker_id} was started for the {spec.kind.value} pool but serves as a "
                                   f"{info.kind.value} worker: the launcher gave it the wrong role")
        except BaseException:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.kill()  # a half-started worker must not linger holding resources
            raise
        finally:
            self.pending[spec.kind] -= 1
        worker = make_worker(info, client)
        self.registry.add(worker)
        self._young[worker] = time.monotonic()
        self._background.spawn(self._watch(worker))
        return worker

    async def _watch(self, worker: Worker) -> None:
        """Ping the worker and refresh its load until it is lost; declare it dead when it stops moving."""
        cfg = self.liveness
        report: asyncio.Task | None = None
        while worker.alive and not self._stopping:
            if self._young.get(worker, math.inf) <= time.monotonic() - cfg.crash_window_s:
                del self._young[worker]  # it outlived the crash window: whatever failed before, the pool works
                self._quick_losses[worker.kind], self._backoff[worker.kind] = 0, 0.0
                self._retry_at[worker.kind] = 0.0
            try:
                hb = await worker.client.ping(cfg.worker_timeout_s)
            except WorkerError as e:
                if e.lost:
                    self.registry.lose(worker, e.reason)
                elif self.follow or not self.authority():  # whether a silent worker is dead is the lead's call
                    await asyncio.sleep(cfg.interval_s)
                elif e.failure is Failure.TIMEOUT:  # the process is stopped, stuck or cut off
                    self.registry.lose(worker, f"no heartbeat within {cfg.worker_timeout_s:.3g}s")
                else:
                    await asyncio.sleep(cfg.interval_s)
                continue
            why = None
            if not hb.loop_alive:
                why = "its engine loop thread is dead"
            elif hb.busy and hb.loop_age_s > cfg.worker_timeout_s:
                why = (f"its engine loop has not moved for {hb.loop_age_s:.1f}s with work to do "
                       f"(--worker-timeout {cfg.worker_timeout_s:.3g}s)")
            if why is not None and not self.follow and self.authority():
                self.registry.lose(worker, why)
                continue
            self.on_heartbeat(worker)
            if report is None or report.done():  # never more than one report in flight per worker
                report = self._background.spawn(self._report(worker))
            await asyncio.sleep(cfg.interval_s)

    async def _report(self, worker: Worker) -> None:
        try:
            r = await worker.client.report(self.cache_cursor(worker), self.liveness.worker_timeout_s)
        except WorkerError as e:
            if e.lost:
                self.registry.lose(worker, e.reason)
            return  # a slow report (a long step) is not death: the ping decides
        if worker.alive:
            self.on_report(worker, r)

