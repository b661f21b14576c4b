"""Router replicas (`pdserve serve --routers N`): several routers over the same worker pools.

Every token of every stream passes through a router process, so one router caps the fleet at about one
core's worth of relaying (README, "What the router costs per token"). With `--routers N`, the process that
runs `pdserve serve` is the *lead* replica and N-1 more run as Ray actors (`RouterReplica`, spread over the
nodes like any other actor). Each binds the same gRPC (and HTTP) port with SO_REUSEPORT, so the kernel
spreads a node's client connections over its replicas; on a cluster, the Service spreads them over nodes.

What they share, and how:
- **The workers.** The lead starts, watches, replaces and declares dead every worker (its `PoolManager`)
  and tells each replica which workers exist (`add_worker`, `lose_worker`). Each replica runs its own
  `Router`: placement, its own requests' lifecycles, pings for its own decode leases' renewals.
- **Load and prefix caches.** Each replica reads every worker's load and numbered prefix-cache change log
  from its own cursor (`Router.apply_report`): one that missed changes reads them again, one the log no
  longer reaches is resynced from a full snapshot. Placement is as good from any replica.
- **KV room.** Decode blocks are reserved on the worker (`DecodeWorker.reserve` answers None when out of
  room), so replicas never double-book; a refused replica tries another worker or queues.
- **Tokens.** Attempt keys carry their replica's id (`engine.messages.owner_of`); a decode worker sends each
  replica the tokens of its own attempts only.
- **Pool changes.** Every replica serves the Admin API: the others forward each call to the lead through a
  mailbox actor (`AdminMailbox`); the lead's drains ask every replica to move its own requests off the
  worker.

A replica that dies (killed, its node gone, or silent for --worker-timeout) takes only its own clients'
connections with it: the lead has every worker free what that replica's attempts held (`release_router`),
and starts a replacement under the same index (so its metrics' `router` label stays bounded). The lead
holds the pools: its process ending ends the deployment, as it did with one router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from engine.messages import WorkerInfo
from router.admin_servicer import Answer, ForwardingAdminServicer, run_forwarded
from router.lifecycle import Method
from router.placement import PoolKind
from router.pool import PoolManager, Worker, WorkerRegistry
from router.router import Router
from router.server import ServeConfig, Server, log
from router.worker_client import RayWorkerClient, WorkerError

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
BACKOFF_MAX_S = 30.0
READOPT_AFTER_S = 1.0  # a follower that lost touch with a worker the lead still has tries it again after this
RELEASE_TRIES = 5  # a dead replica's attempts are released from each worker with this many tries


class AdminMailbox:
    """A Ray actor: Admin calls that reached a replica other than the lead, waiting for the lead to run them
    (the lead is a Ray driver, which takes no calls; it polls `next`)."""

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[tuple[int, str, bytes]] = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()

    async def call(self, method: str, request: bytes) -> Answer:
        n = next(self._ids)
        answer = self._answers[n] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((n, method, request))
        try:
            return await answer
        finally:
            self._answers.pop(n, None)

    async def next(self) -> tuple[int, str, bytes]:
        return await self._inbox.get()

    async def answer(self, n: int, answer: Answer) -> None:
        fut = self._answers.get(n)
        if fut is not None and not fut.done():
            fut.set_result(answer)


class FollowerServer(Server):
    """A router replica other than the lead: the same doors, its own `Router`, the lead's workers."""

    def __init__(self, config: ServeConfig, index: int, router_id: str, mailbox: Any) -> None:
        super().__init__(config)
        self.index = index
        self.router_id = router_id
        self.mailbox = mailbox
        self.reports_pools = False  # pool sizes are the lead's to report
        # every worker the lead told of and has not declared lost (adopted once the router exists; again after
        # this replica lost touch with one)
        self._known: dict[str, tuple[WorkerInfo, PoolKind, Any]] = {}
        self._lost: set[str] = set()  # workers the lead declared lost
        self._readopts: set[asyncio.Task] = set()

    def _metrics_labels(self) -> dict[str, str]:
        return {"router": str(self.index)}

    def _admin_servicer(self):
        return ForwardingAdminServicer(self.mailbox)

    async def _start_router(self) -> None:
        c = self.config
        # NOTE: never kills: the workers are shared, and whether one is dead is the lead's call
        self.registry = WorkerRegistry(kill_on_loss=False)
        self.registry.on_lost.append(self._on_lost)
        self.router = Router(c.router_config(self.router_id), self.registry, observer=self.observer)
        self.pools = PoolManager(c.pool_specs(), self.registry, launch=_no_launch, follow=True,
                                 on_report=self.router.apply_report, on_heartbeat=self.router.on_heartbeat,
                                 cache_cursor=self.router.cache_cursor)
        for info, kind, actor in list(self._known.values()):
            self.add_worker(info, kind, actor)

    def add_worker(self, info: WorkerInfo, kind: PoolKind, actor: Any) -> None:
        if info.worker_id in self._lost:
            return
        self._known[info.worker_id] = (info, kind, actor)
        if self.router is None:
            return
        self.pools.adopt(info, RayWorkerClient(info.worker_id, actor, self.router_id), kind)

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
            self.add_worker(*known)

    def lose_worker(self, worker_id: str, why: str) -> None:
        self._lost.add(worker_id)
        self._known.pop(worker_id, None)
        if self.router is not None and worker_id in self.registry.workers:
            self.registry.lose(self.registry.workers[worker_id], why)

    async def _stop_workers(self) -> None:
        pass  # the lead's


async def _no_launch(spec, worker_id):
    raise AssertionError("a following router replica starts no workers")


class RouterReplica:
    """A Ray actor: one router replica that is not the lead (`FollowerServer` on the actor's event loop)."""

    def __init__(self, config: ServeConfig, index: int, router_id: str, mailbox: Any) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.server = FollowerServer(config, index, router_id, mailbox)

    async def start(self, workers: list[tuple[WorkerInfo, str, Any]]) -> dict:
        for info, kind, actor in workers:
            self.server.add_worker(info, PoolKind(kind), actor)
        await self.server.start()
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "port": self.server.port,
                "metrics_port": self.server.metrics_port, "http_port": self.server.http_port}

    async def add_worker(self, info: WorkerInfo, kind: str, actor: Any) -> None:
        self.server.add_worker(info, PoolKind(kind), actor)

    async def lose_worker(self, worker_id: str, why: str) -> None:
        self.server.lose_worker(worker_id, why)

    async def drain_worker(self, worker_id: str, method: str, timeout_s: float) -> bool:
        """Move this replica's requests off a worker the lead is draining (see `Router.drain_worker`)."""
        worker = self.server.registry.workers.get(worker_id) if self.server.router is not None else None
        if worker is None or not worker.alive:
            return True
        return await self.server.router.drain_worker(worker, Method(method), timeout_s)

    async def ping(self) -> int:
        """Requests in flight here (0 before the router is up)."""
        return len(self.server.router.requests) if self.server.router is not None else 0

    async def describe(self) -> dict:
        """What this replica sees (for operators and tests): its requests, and per worker its prefix index's
        cursor and block count."""
        router = self.server.router
        if router is None:
            return {"requests": 0, "workers": {}}
        return {"requests": len(router.requests),
                "workers": {wid: {"alive": w.alive, "cache_seq": router.index.cursor(wid),
                                  "cached_blocks": router.index.num_blocks(wid)}
                            for wid, w in router.workers.items()}}

    async def shutdown(self, grace_s: float) -> None:
        await self.server.shutdown(grace_s)

    async def stop(self) -> None:
        await self.server.stop()


@dataclass
class _Replica:
    index: int
    router_id: str  # unique per incarnation: a replacement's attempt keys never meet its predecessor's
    actor: Any
    info: dict = field(default_factory=dict)  # what `RouterReplica.start` answered: pid, ports
    started: bool = False


def _end(rep: _Replica) -> None:
    """End a lost replica's process now. NOTE: a stalled one (SIGSTOPped, hung) still holds its share of the
    SO_REUSEPORT group, and the kernel keeps queueing new connections on its socket, where they hang.
    `ray.kill` asks its core worker to exit and force-kills a process that does not answer only about 5 s
    later (measured with a SIGSTOPped actor, Ray 2.60). On this node the lead SIGKILLs the pid at once
    (after checking it is still a RouterReplica process: Ray titles it `ray::RouterReplica`); elsewhere
    `ray.kill` is all there is."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(rep.actor, no_restart=True)
    pid = rep.info.get("pid")
    if not pid or rep.info.get("node_id") != ray.get_runtime_context().get_node_id():
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"ray::RouterReplica"):
                return  # gone, and the pid reused
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass  # gone already
    except OSError as e:
        logger.warning("could not end router replica %d's process %d: %s", rep.index, pid, e)


class ReplicaSet:
    """The lead's side: starts the other replicas, tells them of every worker, watches and replaces them,
    runs their forwarded Admin calls and asks them to drain."""

    def __init__(self, lead: Server, count: int) -> None:
        self.lead = lead
        self.count = count
        self.replicas: dict[int, _Replica] = {}
        self.mailbox: Any = None
        self._incarnations = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self.replaced = 0  # replicas replaced after they died

    def _timeout(self) -> float:
        return self.lead.config.worker_timeout

    async def start(self) -> None:
        import ray

        self.mailbox = ray.remote(AdminMailbox).options(num_cpus=0, max_concurrency=1000).remote()
        self.lead.registry.on_added.append(self._tell_added)
        self.lead.registry.on_lost.append(self._tell_lost)
        await asyncio.gather(*(self._start_one(i) for i in range(1, self.count + 1)))
        self._spawn(self._serve_admin())

    def describe(self) -> list[dict]:
        """Every replica but the lead: index, router id, pid, ports (for operators and tests)."""
        return [{"index": r.index, "router_id": r.router_id, **r.info} for r in self.replicas.values()]

    async def _start_one(self, index: int) -> _Replica:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        lead, c = self.lead, self.lead.config
        # NOTE: the lead's bound ports (a test's 0 became a real port): the replicas share them
        metrics_port = None if c.metrics_port is None else (c.metrics_port + index if c.metrics_port else 0)
        config = dataclasses.replace(c, port=lead.port, http_port=lead.http_port, metrics_port=metrics_port)
        router_id = f"{index}.{next(self._incarnations)}"
        # NOTE: by default on the lead's node, where the exposed port is: SO_REUSEPORT spreads its connections.
        # --routers-spread places them over the nodes, for a Service that reaches every node's port.
        strategy = "SPREAD" if c.routers_spread else NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(RouterReplica).options(
            num_cpus=0, max_concurrency=10_000, max_restarts=0, scheduling_strategy=strategy,
        ).remote(config, index, router_id, self.mailbox)
        rep = self.replicas[index] = _Replica(index, router_id, actor)  # before `start`: it hears of changes
        workers = [(w.info, w.kind.value, w.client.actor) for w in lead.registry.live()]
        try:
            rep.info = await actor.start.remote(workers)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        rep.started = True
        log(f"router replica {index} ({router_id}) serving on port {rep.info['port']} (pid {rep.info['pid']})")
        self._spawn(self._watch(rep))
        return rep

    def _tell_added(self, worker: Worker) -> None:
        for rep in self.replicas.values():
            rep.actor.add_worker.remote(worker.info, worker.kind.value, worker.client.actor)

    def _tell_lost(self, worker: Worker, why: str) -> None:
        for rep in self.replicas.values():
            rep.actor.lose_worker.remote(worker.worker_id, why)

    async def _watch(self, rep: _Replica) -> None:
        """Ping the replica; when it is gone or silent for --worker-timeout, free what it held and replace it."""
        import ray

        while not self._stopping and self.replicas.get(rep.index) is rep:
            try:
                await asyncio.wait_for(rep.actor.ping.remote(), self._timeout())
            except (asyncio.TimeoutError, ray.exceptions.RayActorError) as e:
                why = (f"no answer within {self._timeout():.3g}s" if isinstance(e, asyncio.TimeoutError)
                       else f"its actor died: {e}")
                await self._replace(rep, why)
                return
            except ray.exceptions.RayError:
                pass  # transient (ActorUnavailableError is a RayActorError subclass, caught above as death)
            await asyncio.sleep(PING_INTERVAL_S)

    async def _replace(self, rep: _Replica, why: str) -> None:

        logger.error("router replica %d (%s) lost: %s; its clients' streams end with it", rep.index,
                     rep.router_id, why)
        _end(rep)
        freed = await asyncio.gather(*(self._release(w, rep.router_id) for w in self.lead.registry.live()))
        logger.info("freed %d attempt(s) of router replica %s on the workers", sum(freed), rep.router_id)
        backoff = 0.5
        while not self._stopping:
            try:
                await self._start_one(rep.index)
                self.replaced += 1
                return
            except Exception as e:  # noqa: BLE001 - logged and retried after a backoff
                logger.error("replacement router replica %d failed to start (%s); retrying in %.1fs",
                             rep.index, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _release(self, worker: Worker, router_id: str) -> int:
        """Free a dead replica's attempts on one worker, retrying: a sequence left there would decode on to
        its max_tokens for nobody."""
        for attempt in range(RELEASE_TRIES):
            try:
                return await worker.client.release_router(router_id, self._timeout())
            except WorkerError as e:
                if e.lost or not worker.alive:
                    return 0  # gone with it
                logger.warning("releasing replica %s on %s (try %d): %s", router_id, worker.worker_id,
                               attempt + 1, e)
                await asyncio.sleep(min(2 ** attempt, BACKOFF_MAX_S))
        return 0

    async def _serve_admin(self) -> None:
        """Run the Admin calls the other replicas forward (the lead holds the pools)."""
        import ray

        while not self._stopping:
            try:
                n, method, request = await self.mailbox.next.remote()
            except ray.exceptions.RayError as e:
                logger.error("the Admin mailbox failed (%s); other replicas' Admin calls fail until a restart", e)
                return
            self._spawn(self._answer(n, method, request))

    async def _answer(self, n: int, method: str, request: bytes) -> None:
        answer = await run_forwarded(self.lead.admin_servicer, method, request)  # never raises
        try:
            await self.mailbox.answer.remote(n, answer)
        except Exception as e:  # noqa: BLE001 - the asking replica's call fails with the mailbox
            logger.warning("answering a forwarded %s: %s", method, e)

    async def drain_worker(self, worker: Worker, method: Method, timeout_s: float) -> bool:
        """Every other replica moves its own requests off `worker`; True when all did in time (a replica that
        died meanwhile held nothing more: its attempts were released)."""
        import ray

        async def one(rep: _Replica) -> bool:
            try:
                return await rep.actor.drain_worker.remote(worker.worker_id, method.value, timeout_s)
            except ray.exceptions.RayError:
                return True

        return all(await asyncio.gather(*(one(r) for r in list(self.replicas.values()) if r.started)))

    async def shutdown(self, grace_s: float) -> None:
        """SIGTERM: every replica stops admitting and lets its streams finish within `grace_s`."""
        await asyncio.gather(*(r.actor.shutdown.remote(grace_s) for r in self.replicas.values() if r.started),
                             return_exceptions=True)

    async def stop(self) -> None:
        import ray

        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        reps = list(self.replicas.values())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(r.actor.stop.remote() for r in reps), return_exceptions=True),
                                   timeout=10)
        for actor in [r.actor for r in reps] + [self.mailbox]:
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
