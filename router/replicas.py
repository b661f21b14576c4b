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
- **Tokens.** Attempt keys carry their replica's id (`protocol.messages.owner_of`); a decode worker sends each
  replica the tokens of its own attempts only.
- **Pool changes.** Every replica serves the Admin API: the others forward each call to the lead through a
  mailbox actor (`AdminMailbox`); the lead's drains ask every replica to move its own requests off the
  worker.

A replica that dies (killed, its node gone, or silent for --worker-timeout) takes only its own clients'
connections with it: the lead has every worker free what that replica's attempts held (`release_router`),
and starts a replacement under the same index (so its metrics' `router` label stays bounded).

The lead may die too. The workers, the replicas, the mailbox and the KV rendezvous store are detached Ray
actors, so they outlive it; the lead beats in the mailbox, and when it has been silent for --worker-timeout
the first replica to claim the lead takes the pools over (`FollowerServer._take_over`): it fences the old
lead, frees what its requests held, manages the pools and the Admin API from then on, and starts a replica
in its place. `pdserve stop` (`stop_deployment`) stops such a deployment, whichever replica leads it. A dead
mailbox is recreated by the lead; a dead rendezvous store is restarted by Ray at its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from protocol import Method, PoolKind
from protocol.messages import WorkerInfo
from protocol.node import node_identity
from router.admin import PoolAdmin
from router.admin_servicer import AdminServicer, Answer, ForwardingAdminServicer, run_forwarded
from router.background import Background
from router.pool import LivenessConfig, PoolManager, Worker, WorkerRegistry, ray_launcher
from router.router import Router
from router.server import ServeConfig, ServeError, Server, kv_transfer_config, log
from router.worker_client import RayWorkerClient, WorkerError

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
BACKOFF_MAX_S = 30.0
READOPT_AFTER_S = 1.0  # a follower that lost touch with a worker the lead still has tries it again after this
START_TIMEOUT_S = 20.0  # a replica that has not started serving by then is killed and started again
RELEASE_TRIES = 5  # a dead replica's attempts are released from each worker with this many tries


MAILBOX_NAMESPACE = "pdserve"


def mailbox_name(port: int) -> str:
    """The mailbox actor's name: one deployment with router replicas per port and Ray cluster."""
    return f"routers-{port}"


class AdminMailbox:
    """A Ray actor (detached, named after the port): where the router replicas meet.

    - **Admin calls** that reached a replica other than the lead wait here until the lead runs them (the
      serve process is a Ray driver, which takes no calls; it polls `next`).
    - **The lead's beat**: the lead says every half second that it is alive (`beat`). When it has been
      silent for --worker-timeout, the first replica to `claim_lead` takes the pools over.
    - **Every replica's and worker's handle**, registered before it starts: a new lead adopts the replicas,
      and kills what a dead lead was still starting; the final stop kills them all.
    - **A stop request** (`pdserve stop`), which the lead's next beat picks up (a new lead's, if the lead is
      gone).
    """

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[tuple[int, str, bytes]] = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}
        self._handed: dict[int, str] = {}  # forwarded calls a lead took and has not answered: id -> lead id
        self._ids = itertools.count()
        self._lead: tuple[str, int] = ("", 0)  # the lead's router id and replica index ("", 0: the serve process)
        self._beat = time.monotonic()
        self._targets: dict[str, int] = {}  # the lead's pool targets, by pool kind
        self._replicas: dict[int, str] = {}  # index -> router id of every replica but the lead
        self._workers: set[str] = set()  # the id of every worker ever started
        self._replica_ids: set[str] = set()  # every replica's router id ever registered
        self._incarnations = itertools.count(1)
        self._stop_grace: float | None = None
        self._closing = False  # the lead is stopping the deployment: nobody takes over any more
        self._lead_process: dict = {}

    async def call(self, method: str, request: bytes) -> Answer:
        n = next(self._ids)
        answer = self._answers[n] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((n, method, request))
        try:
            return await answer
        finally:
            self._answers.pop(n, None)
            self._handed.pop(n, None)

    async def next(self, lead_id: str) -> tuple[int, str, bytes] | None:
        """The next forwarded call, for the lead `lead_id`; None when that is no longer the lead (a dead
        lead's poll can still be waiting here: the call goes back for the new lead)."""
        item = await self._inbox.get()
        if lead_id != self._lead[0]:
            self._inbox.put_nowait(item)
            return None
        self._handed[item[0]] = lead_id
        return item

    async def answer(self, n: int, answer: Answer) -> None:
        fut = self._answers.get(n)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    async def beat(self, lead_id: str, targets: dict[str, int], process: dict | None = None) -> tuple[str, float]:
        """The lead is alive (`process`: its pid, node and title, see `this_process`). Answers ("lead", 0),
        ("deposed", 0) when another replica has taken the pools over, or ("stop", grace) when an operator
        asked the deployment to stop."""
        if lead_id != self._lead[0]:
            return "deposed", 0.0
        self._beat = time.monotonic()
        self._targets = targets
        self._lead_process = process or self._lead_process
        return ("stop", self._stop_grace) if self._stop_grace is not None else ("lead", 0.0)

    async def claim_lead(self, router_id: str, index: int, silent_s: float) -> dict | None:
        """Replica `router_id` takes the lead if the lead has not beaten for `silent_s`: what it needs to take
        the pools over (the old lead's id, index and process, its pool targets, the other replicas and every
        worker ever started); None otherwise. The calls the old lead took and never answered fail now."""
        if time.monotonic() - self._beat <= silent_s or self._closing:
            return None
        old_id, old_index = self._lead
        self._lead = (router_id, index)
        self._beat = time.monotonic()
        self._replicas.pop(index, None)
        for n, taker in list(self._handed.items()):
            fut = self._answers.get(n)
            if taker == old_id and fut is not None and not fut.done():
                fut.set_result((False, ("UNAVAILABLE", "the lead router replica died while running this call; "
                                                       "check the pools (ListWorkers) and retry")))
        claim = {"old_router_id": old_id, "old_index": old_index, "old_process": self._lead_process,
                 "targets": dict(self._targets), "replicas": dict(self._replicas), "workers": sorted(self._workers)}
        self._lead_process = {}
        return claim

    async def register(self, index: int, router_id: str) -> None:
        self._replicas[index] = router_id
        self._replica_ids.add(router_id)

    async def register_worker(self, worker_id: str) -> None:
        self._workers.add(worker_id)

    async def names(self) -> list[str]:
        """Every replica's and worker's name under the deployment's (see `Shared.name`), gone ones included."""
        return [f"router-{rid}" for rid in self._replica_ids] + sorted(self._workers)

    async def incarnation(self) -> int:
        """A number no replica of this deployment had: router ids stay unique across leads."""
        return next(self._incarnations)

    async def request_stop(self, grace_s: float) -> str:
        """`pdserve stop`: the lead drains every replica within `grace_s`, then stops the deployment."""
        self._stop_grace = grace_s
        return self._lead[0]

    async def describe(self) -> dict:
        """Who leads (router id, replica index, process) and the other replicas' ids, for operators and tests."""
        return {"lead": self._lead[0], "index": self._lead[1], "process": dict(self._lead_process),
                "replicas": dict(self._replicas)}

    async def restore(self, lead: tuple[str, int], targets: dict[str, int], replicas: dict[int, str],
                      workers: list[str], incarnation: int) -> None:
        """A recreated mailbox (the old one died): what the lead knows, and ids from `incarnation` on."""
        self._lead, self._targets, self._replicas = lead, targets, dict(replicas)
        self._replica_ids |= set(replicas.values())
        self._workers |= set(workers)
        self._incarnations = itertools.count(incarnation)
        self._beat = time.monotonic()

    async def closing(self) -> None:
        """The lead is stopping the deployment: no replica may take over from now on."""
        self._closing = True


class RendezvousHost:
    """A Ray actor holding the KV transfer's rendezvous store (`kv_transfer.RendezvousServer`) on its node's
    cluster address, so that the store outlives the lead (the workers' receivers listen on it).

    NOTE: it binds a port chosen before it was created, and Ray restarts it on its node when its process
    dies: the store is back at the same address, where the workers' receivers reconnect by themselves
    (`TorchKVReceiver._listen`) and senders connect per link. Links already made never needed it. What the
    store held dies with it: link requests not yet popped (their senders time out and the link is retried)."""

    def __init__(self, port: int) -> None:
        from kv_transfer import RendezvousServer

        self.server = RendezvousServer(node_identity()[1], port)

    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port


def _free_port(host: str) -> int:
    """A port nothing listens on at `host` now (the store binds it, and binds it again when restarted)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Shared:
    """What outlives the lead, and what a replica needs to take the pools over.

    NOTE: every detached actor of the deployment is *named* (Ray namespace `pdserve`, names under
    `routers-<port>`), and replicas find each other, the workers, the mailbox and the store by name, never
    through a handle another process passed them: a handle is owned by the process that made it, and
    nothing a new lead holds should hang on a lead that died. (Names were not enough on their own for the
    SIGSTOPped-lead case: see `_fence`.) Operators see the same names in `ray list actors`.
    """

    port: int  # the deployment's gRPC port: its names' root
    kv_config: Any  # the workers' kv_transfer.KVTransferConfig (None: colocated pools)
    lease_s: float  # how long a decode reservation outlives its last renewal
    # NOTE: only on a Ray cluster the serve process joined. One it started itself ends with it, so there is
    # nothing to take over, and fencing a merely stalled lead would end what a stall alone would not.
    failover: bool = True

    def name(self, what: str) -> str:
        """The name of one of the deployment's actors: a worker id, "router-<router id>", "rendezvous"."""
        return f"{mailbox_name(self.port)}/{what}"

    def mailbox(self) -> Any:
        return named(mailbox_name(self.port))

    def worker_name(self, worker_id: str) -> tuple[str, str]:
        """`ray_launcher`'s detached_name."""
        return self.name(worker_id), MAILBOX_NAMESPACE

    def launcher(self, router_id: str) -> Any:
        """Starts the deployment's workers: detached, named, registered in the mailbox before they are ready."""
        return ray_launcher(self.kv_config, self.lease_s, router_id, self.worker_name, self.register_worker)

    def register_worker(self, worker_id: str, actor: Any) -> None:
        """`ray_launcher`'s on_launch: the mailbox learns of every worker before it is ready."""
        self.mailbox().register_worker.remote(worker_id)

    async def close(self, keep: str) -> None:
        """After the workers: kill whatever the mailbox knows of (a worker or replica a dead lead was still
        starting) but `keep` (the caller's own name), then the store (the workers held clients of it) and
        the mailbox."""
        import ray

        with contextlib.suppress(Exception):
            names = await asyncio.wait_for(self.mailbox().names.remote(), 10)
            for what in [*names, "rendezvous"]:
                if what != keep:
                    _kill_named(self.name(what))
        with contextlib.suppress(Exception):
            ray.kill(self.mailbox())


def named(name: str) -> Any:
    """The deployment's actor called `name` (ValueError when there is none)."""
    import ray

    return ray.get_actor(name, namespace=MAILBOX_NAMESPACE)


def _kill_named(name: str) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.kill(named(name))


def _this_node() -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def refuse_taken_port(port: int) -> None:
    """ServeError when a deployment with router replicas already has `port` in this Ray cluster."""
    with contextlib.suppress(ValueError):
        named(mailbox_name(port))
        raise ServeError(f"another pdserve deployment with router replicas serves port {port} in this Ray cluster; "
                         f"stop it with `pdserve stop --port {port}`, or pass another --port")


async def _create_mailbox(port: int) -> Any:
    import ray

    mailbox = ray.remote(AdminMailbox).options(
        name=mailbox_name(port), namespace=MAILBOX_NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=1000, scheduling_strategy=_this_node()).remote()
    await mailbox.incarnation.remote()  # created (a taken name fails here or above)
    return mailbox


async def start_shared(config: ServeConfig, port: int, lease_s: float) -> Shared:
    """The lead's first step with replicas: the mailbox (refused when another deployment with replicas has
    this port in this Ray cluster) and the rendezvous store, both detached and named."""
    import ray

    try:
        await _create_mailbox(port)
    except (ValueError, ray.exceptions.RayError) as e:
        raise ServeError(f"another pdserve deployment with router replicas serves port {port} in this Ray "
                         f"cluster ({e}); stop it with `pdserve stop --port {port}`, or pass another --port") from e
    shared = Shared(port, None, lease_s, failover=config.ray_address is not None)
    store = None
    if config.needs_rendezvous:
        host = ray.remote(RendezvousHost).options(
            name=shared.name("rendezvous"), namespace=MAILBOX_NAMESPACE, num_cpus=0, lifetime="detached",
            max_restarts=-1, scheduling_strategy=_this_node()).remote(_free_port(node_identity()[1]))
        store = await host.address.remote()
    return dataclasses.replace(shared, kv_config=kv_transfer_config(config, store))


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
        self._known: dict[str, tuple[WorkerInfo, PoolKind]] = {}
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
        for info, kind in list(self._known.values()):
            self.add_worker(info, kind)
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

    async def _take_over(self, claim: dict) -> None:
        """The lead is gone: this replica holds the pools from now on. It declares workers dead and replaces
        them (at the old lead's targets), frees what the old lead's requests held, serves the Admin API,
        watches the other replicas and starts a new one in the old lead's place."""
        c = self.config
        log(f"router replica {self.index} ({self.router_id}): the lead "
            f"({claim['old_router_id'] or 'the serve process'}) is silent; taking the pools over")
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
                           {PoolKind(k): n for k, n in claim["targets"].items()})
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

    def add_worker(self, info: WorkerInfo, kind: PoolKind) -> None:
        """The lead started a worker (or had it when this replica started): adopt it, found by name."""
        if info.worker_id in self._lost:
            return
        self._known[info.worker_id] = (info, kind)
        if self.router is None:
            return
        try:
            actor = named(self.shared.name(info.worker_id))
        except ValueError:
            logger.warning("worker %s is gone already; the lead will say so", info.worker_id)
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
        if self.leading:  # the serve process's, unless this replica took the pools over
            await super()._stop_workers()


async def _no_launch(spec, worker_id):
    raise AssertionError("a following router replica starts no workers")


class RouterReplica:
    """A Ray actor: one router replica that is not the lead (`FollowerServer` on the actor's event loop)."""

    def __init__(self, config: ServeConfig, index: int, router_id: str, shared: Shared) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.server = FollowerServer(config, index, router_id, shared)

    async def start(self, workers: list[tuple[WorkerInfo, str]]) -> dict:
        for info, kind in workers:
            self.server.add_worker(info, PoolKind(kind))
        await self.server.start()
        return await self.describe_process()

    async def describe_process(self) -> dict:
        """pid, node id and bound ports."""
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "port": self.server.port,
                "metrics_port": self.server.metrics_port, "http_port": self.server.http_port}

    async def add_worker(self, info: WorkerInfo, kind: str) -> None:
        self.server.add_worker(info, PoolKind(kind))

    async def lose_worker(self, worker_id: str, why: str) -> None:
        self.server.lose_worker(worker_id, why)

    async def use_mailbox(self) -> None:
        self.server.use_mailbox()

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
    later (measured with a SIGSTOPped actor, Ray 2.60); on this node the lead SIGKILLs it at once."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(rep.actor, no_restart=True)
    _kill_process(rep.info, b"ray::RouterReplica")


def _local_pid(process: dict) -> int | None:
    """`process`'s pid ({"pid", "node_id"}) when it runs on this node; None otherwise."""
    import ray

    pid = process.get("pid")
    return pid if pid and process.get("node_id") == ray.get_runtime_context().get_node_id() else None


def _is_process(pid: int, title: bytes) -> bool:
    """Whether `pid` is alive and its command line still starts with `title` (else it is gone, and the pid
    may be another process's now)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(title)
    except OSError:
        return False


def _kill_process(process: dict, title: bytes) -> None:
    """SIGKILL `process` if it runs on this node and is still the process `title` names; elsewhere, nothing."""
    pid = _local_pid(process)
    if pid is None or not _is_process(pid, title):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone meanwhile
    except OSError as e:
        logger.warning("could not end process %d: %s", pid, e)


async def _fence(process: dict, grace_s: float) -> None:
    """End a lead another replica took over from, when it runs on this node: wake it (SIGCONT: a stopped
    one), give it `grace_s` to learn at its next beat that it was deposed and exit, then SIGKILL it.
    NOTE: a SIGKILL straight into a SIGSTOPped serve process (a Ray driver) killed the new lead itself half
    a second later, or left it unable to start the replacement replica (Ray 2.60, reproduced every time);
    a driver that exits by itself, or is killed while running, does not."""
    pid = _local_pid(process)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _is_process(pid, process["title"]):
        await asyncio.sleep(0.1)
    _kill_process(process, process["title"])


def this_process() -> dict:
    """{"pid", "node_id", "title"} of the calling process; the title is how its command line starts: the
    whole of it, or a Ray actor's `ray::Class` (Ray rewrites the rest)."""
    import ray

    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    title = cmdline.split(b"\0")[0].split(b".")[0] if cmdline.startswith(b"ray::") else cmdline
    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "title": title}


class ReplicaSet:
    """The lead's side: starts the other replicas, tells them of every worker, watches and replaces them,
    runs their forwarded Admin calls, asks them to drain, and beats in the mailbox."""

    def __init__(self, lead: Server, count: int) -> None:
        self.lead = lead
        self.count = count
        self.replicas: dict[int, _Replica] = {}
        self.mailbox: Any = lead.shared.mailbox() if lead.shared is not None else None
        self._background = Background()
        self._stopping = False
        self._confirmed = time.monotonic()  # when the mailbox last answered that this is the lead
        self.replaced = 0  # replicas replaced after they died

    def _timeout(self) -> float:
        return self.lead.config.worker_timeout

    def leads(self) -> bool:
        """Whether this lead may act on the pools and the replicas (declare dead, kill, start): the mailbox
        confirmed it within half of --worker-timeout, well before another replica could claim the lead."""
        return time.monotonic() - self._confirmed < self._timeout() / 2

    async def start(self) -> None:
        """The serve process: start the other replicas (indexes 1..count)."""
        self._background.spawn(self._beat())
        self.lead.registry.on_added.append(self._tell_added)
        self.lead.registry.on_lost.append(self._tell_lost)
        started = await asyncio.gather(*(self._start_one(i) for i in range(1, self.count + 1)),
                                       return_exceptions=True)  # (all of them in `replicas`, for a stop)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        self._background.spawn(self._serve_admin())

    async def take_over(self, claim: dict) -> None:
        """A replica that took the pools over (see `FollowerServer._take_over`): fence the old lead, adopt
        the other replicas, kill what the old lead was still starting, free what its requests held, and
        start a replica in its place."""

        # NOTE: fence the old lead first: a stalled one still holds its share of the port (new connections
        # would hang there), and one that wakes up must not act on the pools again (a lead on another node
        # stops itself at its next beat: "deposed", and acts on nothing before it: `leads`)
        old = claim["old_process"]
        if old:
            await _fence(old, self._timeout())
        shared = self.lead.shared
        for index, router_id in claim["replicas"].items():  # before any wait: a stop sees them
            try:
                actor = named(shared.name(f"router-{router_id}"))
            except ValueError:  # gone: start another in its place
                self._background.spawn(self._start_with_retries(index))
                continue
            self.replicas[index] = _Replica(index, router_id, actor, started=True)
        known = set(self.lead.registry.workers)
        for worker_id in claim["workers"]:
            if worker_id not in known:  # the old lead was starting it
                logger.info("killing worker %s, which the old lead started and this replica never heard of",
                            worker_id)
                _kill_named(shared.name(worker_id))
        self._background.spawn(self._beat())
        self.lead.registry.on_added.append(self._tell_added)
        self.lead.registry.on_lost.append(self._tell_lost)
        self._background.spawn(self._serve_admin())
        for rep in list(self.replicas.values()):
            with contextlib.suppress(Exception):  # one that does not answer is replaced by `_watch`
                rep.info = await asyncio.wait_for(rep.actor.describe_process.remote(), self._timeout())
            self._background.spawn(self._watch(rep))
        self._background.spawn(self._start_with_retries(claim["old_index"]))
        freed = await asyncio.gather(*(self._release(w, claim["old_router_id"]) for w in self.lead.registry.live()))
        logger.info("freed %d attempt(s) of the old lead on the workers", sum(freed))

    def describe(self) -> list[dict]:
        """Every replica but the lead: index, router id, pid, ports (for operators and tests)."""
        return [{"index": r.index, "router_id": r.router_id, **r.info} for r in self.replicas.values()]

    def _metrics_port(self, index: int) -> int | None:
        """Replica `index` serves /metrics on the deployment's --metrics-port + index (None: off; 0: any)."""
        c = self.lead.config
        return c.metrics_port - self.lead.index + index if c.metrics_port else c.metrics_port

    async def _start_one(self, index: int) -> _Replica:
        import ray

        lead, c = self.lead, self.lead.config
        # NOTE: the lead's bound ports (a test's 0 became a real port): the replicas share them
        config = dataclasses.replace(c, port=lead.port, http_port=lead.http_port, metrics_port=self._metrics_port(index))
        router_id = f"{index}.{await self.mailbox.incarnation.remote()}"
        # NOTE: by default on the lead's node, where the exposed port is: SO_REUSEPORT spreads its connections.
        # --routers-spread places them over the nodes, for a Service that reaches every node's port.
        strategy = "SPREAD" if c.routers_spread else _this_node()
        await self.mailbox.register.remote(index, router_id)  # first: a new lead adopts or stops it
        actor = ray.remote(RouterReplica).options(
            num_cpus=0, max_concurrency=10_000, max_restarts=0, scheduling_strategy=strategy, lifetime="detached",
            name=lead.shared.name(f"router-{router_id}"), namespace=MAILBOX_NAMESPACE,
        ).remote(config, index, router_id, lead.shared)
        rep = self.replicas[index] = _Replica(index, router_id, actor)  # before `start`: it hears of changes
        workers = [(w.info, w.kind.value) for w in lead.registry.live()]
        try:
            # NOTE: bounded: a replica created while Ray was ending a dead lead's job never started (Ray 2.60:
            # its creation finished, the start call never reached it); the retry starts another
            rep.info = await asyncio.wait_for(actor.start.remote(workers), max(START_TIMEOUT_S, self._timeout()))
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        rep.started = True
        log(f"router replica {index} ({router_id}) serving on port {rep.info['port']} (pid {rep.info['pid']})")
        self._background.spawn(self._watch(rep))
        return rep

    async def _beat(self) -> None:
        """Tell the mailbox this lead is alive (and its pool targets), every half second. Stop serving when
        another replica took the pools over meanwhile; drain and stop when an operator asked."""
        import ray

        process = this_process()
        asked = False
        while not self._stopping:
            targets = {kind.value: n for kind, n in self.lead.pools.targets.items()}
            try:
                state, grace = await self.mailbox.beat.remote(self.lead.router_id, targets, process)
            except ray.exceptions.RayActorError as e:
                logger.error("the replicas' mailbox died (%s); recreating it", e)
                with contextlib.suppress(Exception):
                    await self._recreate_mailbox(targets)
            except ray.exceptions.RayError as e:
                logger.warning("cannot reach the replicas' mailbox: %s", e)
            else:
                if state == "deposed":
                    self.lead.deposed("another")
                    return
                self._confirmed = time.monotonic()
                if state == "stop" and not asked:
                    asked = True  # and beat on while it drains: nobody takes over meanwhile
                    self.lead.stop_requested(grace)
            await asyncio.sleep(PING_INTERVAL_S)

    async def _recreate_mailbox(self, targets: dict[str, int]) -> None:
        """The mailbox died (killed, its node gone): make a new one under the same name, tell it what this
        lead knows, and have every replica (and this one, if it is a replica) find it again. Admin calls
        through the other replicas fail UNAVAILABLE meanwhile; elections wait for it."""
        lead = self.lead
        mailbox = await _create_mailbox(lead.shared.port)
        replicas = {r.index: r.router_id for r in self.replicas.values()}
        seen = [int(rid.rsplit(".", 1)[1]) for rid in [*replicas.values(), lead.router_id] if "." in rid]
        await mailbox.restore.remote((lead.router_id, lead.index), targets, replicas, list(lead.registry.workers),
                                     max(seen, default=0) + 1)
        self.mailbox = mailbox
        if isinstance(lead, FollowerServer):
            lead.use_mailbox()
        await asyncio.gather(*(r.actor.use_mailbox.remote() for r in self.replicas.values() if r.started),
                             return_exceptions=True)
        self._background.spawn(self._serve_admin())  # the old loop ended with the old mailbox
        log(f"recreated the replicas' mailbox ({len(replicas)} replica(s), {len(lead.registry.workers)} worker(s))")

    def _tell_added(self, worker: Worker) -> None:
        for rep in self.replicas.values():
            rep.actor.add_worker.remote(worker.info, worker.kind.value)

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
                if not self.leads():  # (e.g. this lead was the one stopped): no kill on stale evidence
                    await asyncio.sleep(PING_INTERVAL_S)
                    continue
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
        await self._start_with_retries(rep.index)

    async def _start_with_retries(self, index: int) -> None:
        backoff = 0.5
        while not self._stopping:
            try:
                await self._start_one(index)
                self.replaced += 1
                return
            except Exception as e:  # noqa: BLE001 - logged and retried after a backoff
                logger.error("replacement router replica %d failed to start (%s); retrying in %.1fs",
                             index, e, backoff)
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
                call = await self.mailbox.next.remote(self.lead.router_id)
            except ray.exceptions.RayError as e:
                logger.warning("the replicas' mailbox failed (%s); the lead's next beat recreates it", e)
                return
            if call is None:
                return  # no longer the lead
            self._background.spawn(self._answer(*call))

    async def _answer(self, n: int, method: str, request: bytes) -> None:
        answer = await run_forwarded(self.lead.admin_runner, method, request)  # never raises
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

    async def stop(self, everything: bool = True) -> None:
        """Stop watching; with `everything`, stop and kill every other replica too (a deposed lead leaves
        them to the new one)."""

        if everything:
            with contextlib.suppress(Exception):  # first: no replica claims the lead while they stop
                await asyncio.wait_for(self.mailbox.closing.remote(), timeout=5)
        self._stopping = True
        self._background.cancel()
        if not everything:
            return
        reps = list(self.replicas.values())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(r.actor.stop.remote() for r in reps), return_exceptions=True),
                                   timeout=10)
        for rep in reps:
            _end(rep)


def stop_deployment(port: int, grace_s: float, wait_s: float = 60.0) -> str:
    """`pdserve stop`: ask the deployment with router replicas on `port` in the joined Ray cluster to drain
    (up to `grace_s`) and stop, and wait until it has. Returns the lead's router id ("" for the serve
    process). Its lead, whichever replica it is now, runs the stop on its next beat."""
    import ray

    try:
        mailbox = named(mailbox_name(port))
    except ValueError as e:
        raise ServeError(f"no pdserve deployment with router replicas serves port {port} in this Ray cluster "
                         "(a lone router stops with SIGTERM or Ctrl-C to its `pdserve serve` process)") from e
    lead = ray.get(mailbox.request_stop.remote(grace_s), timeout=30)
    deadline = time.monotonic() + grace_s + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(mailbox.describe.remote(), timeout=5)  # a read: it answers until the lead kills it
        except ray.exceptions.RayActorError:
            return lead
        except ray.exceptions.GetTimeoutError:
            pass  # slow, not gone
        time.sleep(0.5)
    raise ServeError(f"the deployment on port {port} did not stop within {grace_s + wait_s:.0f}s: its lead "
                     f"({lead or 'the serve process'}) did not act on the request; is it alive?")
