"""A router replica other than the lead (`FollowerServer`), and the Ray actor that runs one
(`RouterReplica`). See `control.replica_set` for how the replicas share the pools."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from control.admin import PoolAdmin
from control.admin_servicer import AdminServicer, ForwardingAdminServicer
from control.config import ServeConfig
from control.console import log
from control.mailbox import named
from control.messages import LeadClaim, ReplicaProcess, ReplicaView, WorkerView
from control.replica_set import ReplicaSet
from control.server import Server
from control.shared import Shared
from protocol import Method
from protocol.messages import WorkerInfo
from router.pool import LivenessConfig, PoolManager
from router.registry import Worker, WorkerRegistry
from router.router import Router
from router.worker_client import RayWorkerClient, WorkerError

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5  # how often a follower asks whether the lead is silent
READOPT_AFTER_S = 1.0  # a follower that lost touch with a worker the lead still has tries it again after this


class FollowerServer(Server):
    """A router replica other than the lead: the same doors, its own `Router`, the lead's workers. When the
    lead falls silent, the first replica to claim the lead takes the pools over (`_take_over`)."""

    def __init__(self, config: ServeConfig, index: int, router_id: str, shared: Shared) -> None:
        super().__init__(config)
        self.index = index
        self.router_id = router_id
        self.shared = shared
        self.mailbox = shared.mailbox()
        self.leading = False
        self.reports_pools = False  # pool sizes are the lead's to report
        # every worker the lead told of and has not declared lost (adopted once the router exists; again after
        # this replica lost touch with one)
        self._known: dict[str, WorkerInfo] = {}
        self._lost: set[str] = set()  # workers the lead declared lost
        self._readopts: set[asyncio.Task] = set()

    def _metrics_labels(self) -> dict[str, str]:
        return {"router": str(self.index)}

    def use_mailbox(self) -> None:
        """The lead recreated the mailbox: find the new one (by name)."""
        self.mailbox = self.shared.mailbox()
        if isinstance(self.admin_servicer, ForwardingAdminServicer):
            self.admin_servicer.mailbox = self.mailbox

    def _admin_servicer(self):
        return ForwardingAdminServicer(self.mailbox)

    async def _start_router(self) -> None:
        c = self.config
        # NOTE: never kills: the workers are shared, and whether one is dead is the lead's call
        self.registry = WorkerRegistry(kill_on_loss=False)
        self.registry.on_lost.append(self._on_lost)
        self.router = Router(c.router_config(self.router_id), self.registry, observer=self.observer)
        self.pools = PoolManager(c.pool_specs(), self.registry, _no_launch,
                                 LivenessConfig(worker_timeout_s=c.worker_timeout), follow=True,
                                 on_report=self.router.apply_report, on_heartbeat=self.router.on_heartbeat,
                                 cache_cursor=self.router.cache_cursor, max_workers=c.max_pool_size)
        for known in list(self._known.values()):
            self.add_worker(known)
        if self.shared.failover:
            self._tasks.append(asyncio.ensure_future(self._watch_lead()))

    async def _watch_lead(self) -> None:
        """Claim the lead whenever the lead has been silent for --worker-timeout (the mailbox grants it to
        the first replica that asks)."""
        import ray

        while not self._stopped:
            await asyncio.sleep(PING_INTERVAL_S)
            try:
                claim = await self.mailbox.claim_lead.remote(self.router_id, self.index, self.config.worker_timeout)
            except ray.exceptions.RayError as e:
                logger.warning("cannot reach the replicas' mailbox: %s", e)
                continue
            if claim is not None:
                await self._take_over(claim)
                return

    async def _take_over(self, claim: LeadClaim) -> None:
        """The lead is gone: this replica holds the pools from now on. It declares workers dead and replaces
        them (at the old lead's targets), frees what the old lead's requests held, serves the Admin API,
        watches the other replicas and starts a new one in the old lead's place."""
        c = self.config
        old_lead = "the serve process" if claim.old_router_id is None else claim.old_router_id
        log(f"router replica {self.index} ({self.router_id}): the lead ({old_lead}) is silent; taking the pools over")
        self.leading = True
        self.reports_pools = True
        self.registry.kill_on_loss = True
        self.registry.on_lost.remove(self._on_lost)
        for task in list(self._readopts):
            task.cancel()
        for worker in self.registry.workers.values():  # lost touch with, not taken back: not trusted now
            if not worker.alive and worker.worker_id not in self._lost:
                with contextlib.suppress(Exception):
                    worker.client.kill()
        self.pools.promote(self.shared.launcher(self.router_id),
                           dict(claim.targets))
        self._tasks.append(asyncio.ensure_future(self.pools.maintain()))
        self.admin_runner = AdminServicer()
        self.admin = self.admin_runner.admin = PoolAdmin(self.router, self.pools)
        self.replicas = ReplicaSet(self, c.routers - 1)
        self.pools.authority = self.replicas.leads
        self.admin.drain_elsewhere = self.replicas.drain_worker
        await self.replicas.take_over(claim)

    async def _stop_and_exit(self, grace_s: float | None) -> None:
        import ray

        await super()._stop_and_exit(grace_s)
        # NOTE: a detached actor lives until killed: this replica's own actor is the last thing left of it
        ray.kill(ray.get_runtime_context().current_actor)

    def add_worker(self, info: WorkerInfo) -> None:
        """The lead started a worker (or had it when this replica started): adopt it, found by name."""
        if info.worker_id in self._lost:
            return
        self._known[info.worker_id] = info
        if self.router is None:
            return
        try:
            actor = named(self.shared.name(info.worker_id))
        except ValueError:
            logger.warning("worker %s is gone already; the lead will say so", info.worker_id)
            return
        self.pools.adopt(info, RayWorkerClient(info.worker_id, actor, self.router_id))

    def _on_lost(self, worker: Worker, why: str) -> None:
        """This replica lost touch with a worker (its step stream broke, a call found it gone): its own
        attempts there have failed over. Unless the lead declares it lost, try it again."""
        if worker.worker_id not in self._lost:
            task = asyncio.ensure_future(self._readopt(worker))
            self._readopts.add(task)
            task.add_done_callback(self._readopts.discard)

    async def _readopt(self, worker: Worker) -> None:
        await asyncio.sleep(READOPT_AFTER_S)
        if worker.worker_id in self._lost or self._stopped:
            return
        try:  # what this replica's failed-over attempts still hold there goes first
            await worker.client.release_router(self.router_id, self.config.worker_timeout, final=False)
        except WorkerError as e:
            logger.warning("not taking %s back: %s", worker.worker_id, e)
            return  # gone: the lead will say so
        known = self._known.get(worker.worker_id)
        if known is not None:
            logger.info("taking %s back after losing touch with it", worker.worker_id)
            self.add_worker(known)

    def lose_worker(self, worker_id: str, why: str) -> None:
        self._lost.add(worker_id)
        self._known.pop(worker_id, None)
        if self.router is not None and worker_id in self.registry.workers:
            self.registry.lose(self.registry.workers[worker_id], why)

    async def _stop_workers(self) -> None:
        if self.leading:  # the serve process's, unless this replica took the pools over
            await super()._stop_workers()


async def _no_launch(spec, worker_id):
    raise AssertionError("a following router replica starts no workers")


class RouterReplica:
    """A Ray actor: one router replica that is not the lead (`FollowerServer` on the actor's event loop)."""

    def __init__(self, config: ServeConfig, index: int, router_id: str, shared: Shared) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.server = FollowerServer(config, index, router_id, shared)

    async def start(self, workers: list[WorkerInfo]) -> ReplicaProcess:
        for info in workers:
            self.server.add_worker(info)
        await self.server.start()
        return await self.describe_process()

    async def describe_process(self) -> ReplicaProcess:
        """pid, node id and bound ports."""
        import ray

        return ReplicaProcess(os.getpid(), ray.get_runtime_context().get_node_id(), self.server.port,
                              self.server.metrics_port, self.server.http_port)

    async def add_worker(self, info: WorkerInfo) -> None:
        self.server.add_worker(info)

    async def lose_worker(self, worker_id: str, why: str) -> None:
        self.server.lose_worker(worker_id, why)

    async def use_mailbox(self) -> None:
        self.server.use_mailbox()

    async def drain_worker(self, worker_id: str, method: Method, timeout_s: float) -> bool:
        """Move this replica's requests off a worker the lead is draining (see `Router.drain_worker`)."""
        worker = self.server.registry.workers.get(worker_id) if self.server.router is not None else None
        if worker is None or not worker.alive:
            return True
        return await self.server.router.drain_worker(worker, method, timeout_s)

    async def ping(self) -> int:
        """Requests in flight here (0 before the router is up)."""
        return len(self.server.router.requests) if self.server.router is not None else 0

    async def describe(self) -> ReplicaView:
        """What this replica sees (for operators and tests): its requests, and per worker its prefix index's
        cursor and block count."""
        router = self.server.router
        if router is None:
            return ReplicaView(0)
        return ReplicaView(len(router.requests),
                           {wid: WorkerView(w.alive, router.index.cursor(wid), router.index.num_blocks(wid))
                            for wid, w in router.workers.items()})

    async def shutdown(self, grace_s: float) -> None:
        await self.server.shutdown(grace_s)

    async def stop(self) -> None:
        await self.server.stop()
