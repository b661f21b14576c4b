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
  mailbox actor (`control.mailbox.AdminMailbox`); the lead's drains ask every replica to move its own requests off the
  worker.

A replica that dies (killed, its node gone, or silent for --worker-timeout) takes only its own clients'
connections with it: the lead has every worker free what that replica's attempts held (`release_router`),
and starts a replacement under the same index (so its metrics' `router` label stays bounded).

The lead may die too. The workers, the replicas, the mailbox and the KV rendezvous store are detached Ray
actors, so they outlive it; the lead beats in the mailbox, and when it has been silent for --worker-timeout
the first replica to claim the lead takes the pools over (`control.follower.FollowerServer._take_over`): it fences the old
lead, frees what its requests held, manages the pools and the Admin API from then on, and starts a replica
in its place. `pdserve stop` (`stop_deployment`) stops such a deployment, whichever replica leads it. A dead
mailbox is recreated by the lead; a dead rendezvous store is restarted by Ray at its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from control.admin_servicer import run_forwarded
from control.console import ServeError, log
from control.mailbox import MAILBOX_NAMESPACE, create_mailbox, kill_named, mailbox_name, named
from control.messages import LeadClaim, ReplicaEntry, ReplicaProcess
from control.processes import fence, kill_process, this_node, this_process
from control.server import Server
from protocol import Method, PoolKind
from protocol.messages import RouterId
from router.background import Background
from router.registry import Worker
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
BACKOFF_MAX_S = 30.0
START_TIMEOUT_S = 20.0  # a replica that has not started serving by then is killed and started again
RELEASE_TRIES = 5  # a dead replica's attempts are released from each worker with this many tries


@dataclass
class _Replica:
    index: int
    router_id: str  # unique per incarnation: a replacement's attempt keys never meet its predecessor's
    actor: Any
    info: ReplicaProcess | None = None  # what `RouterReplica.start` answered: pid, ports
    started: bool = False


def _end(rep: _Replica) -> None:
    """End a lost replica's process now. NOTE: a stalled one (SIGSTOPped, hung) still holds its share of the
    SO_REUSEPORT group, and the kernel keeps queueing new connections on its socket, where they hang.
    `ray.kill` asks its core worker to exit and force-kills a process that does not answer only about 5 s
    later (measured with a SIGSTOPped actor, Ray 2.60); on this node the lead SIGKILLs it at once."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(rep.actor, no_restart=True)
    kill_process(rep.info.process if rep.info is not None else None)



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

    async def take_over(self, claim: LeadClaim) -> None:
        """A replica that took the pools over (see `FollowerServer._take_over`): fence the old lead, adopt
        the other replicas, kill what the old lead was still starting, free what its requests held, and
        start a replica in its place."""

        # NOTE: fence the old lead first: a stalled one still holds its share of the port (new connections
        # would hang there), and one that wakes up must not act on the pools again (a lead on another node
        # stops itself at its next beat: "deposed", and acts on nothing before it: `leads`)
        if claim.old_process is not None:
            await fence(claim.old_process, self._timeout())
        shared = self.lead.shared
        for index, router_id in claim.replicas.items():  # before any wait: a stop sees them
            try:
                actor = named(shared.name(f"router-{router_id}"))
            except ValueError:  # gone: start another in its place
                self._background.spawn(self._start_with_retries(index))
                continue
            self.replicas[index] = _Replica(index, router_id, actor, started=True)
        known = set(self.lead.registry.workers)
        for worker_id in claim.workers:
            if worker_id not in known:  # the old lead was starting it
                logger.info("killing worker %s, which the old lead started and this replica never heard of",
                            worker_id)
                kill_named(shared.name(worker_id))
        self._background.spawn(self._beat())
        self.lead.registry.on_added.append(self._tell_added)
        self.lead.registry.on_lost.append(self._tell_lost)
        self._background.spawn(self._serve_admin())
        for rep in list(self.replicas.values()):
            with contextlib.suppress(Exception):  # one that does not answer is replaced by `_watch`
                rep.info = await asyncio.wait_for(rep.actor.describe_process.remote(), self._timeout())
            self._background.spawn(self._watch(rep))
        self._background.spawn(self._start_with_retries(claim.old_index))
        freed = await asyncio.gather(*(self._release(w, claim.old_router_id) for w in self.lead.registry.live()))
        logger.info("freed %d attempt(s) of the old lead on the workers", sum(freed))

    def describe(self) -> list[ReplicaEntry]:
        """Every replica but the lead: index, router id, pid, ports (for operators and tests)."""
        return [ReplicaEntry(r.index, r.router_id, r.info) for r in self.replicas.values()]

    def _metrics_port(self, index: int) -> int | None:
        """Replica `index` serves /metrics on the deployment's --metrics-port + index (None: off; 0: any)."""
        c = self.lead.config
        return c.metrics_port - self.lead.index + index if c.metrics_port else c.metrics_port

    async def _start_one(self, index: int) -> _Replica:
        import ray

        from control.follower import RouterReplica  # (it imports this module)

        lead, c = self.lead, self.lead.config
        # NOTE: the lead's bound ports (a test's 0 became a real port): the replicas share them
        config = dataclasses.replace(c, port=lead.port, http_port=lead.http_port, metrics_port=self._metrics_port(index))
        router_id = f"{index}.{await self.mailbox.incarnation.remote()}"
        # NOTE: by default on the lead's node, where the exposed port is: SO_REUSEPORT spreads its connections.
        # --routers-spread places them over the nodes, for a Service that reaches every node's port.
        strategy = "SPREAD" if c.routers_spread else this_node()
        await self.mailbox.register.remote(index, router_id)  # first: a new lead adopts or stops it
        actor = ray.remote(RouterReplica).options(
            num_cpus=0, max_concurrency=10_000, max_restarts=0, scheduling_strategy=strategy, lifetime="detached",
            name=lead.shared.name(f"router-{router_id}"), namespace=MAILBOX_NAMESPACE,
        ).remote(config, index, router_id, lead.shared)
        rep = self.replicas[index] = _Replica(index, router_id, actor)  # before `start`: it hears of changes
        workers = [w.info for w in lead.registry.live()]
        try:
            # NOTE: bounded: a replica created while Ray was ending a dead lead's job never started (Ray 2.60:
            # its creation finished, the start call never reached it); the retry starts another
            rep.info = await asyncio.wait_for(actor.start.remote(workers), max(START_TIMEOUT_S, self._timeout()))
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        rep.started = True
        log(f"router replica {index} ({router_id}) serving on port {rep.info.port} (pid {rep.info.pid})")
        self._background.spawn(self._watch(rep))
        return rep

    async def _beat(self) -> None:
        """Tell the mailbox this lead is alive (and its pool targets), every half second. Stop serving when
        another replica took the pools over meanwhile; drain and stop when an operator asked."""
        import ray

        process = this_process()
        asked = False
        while not self._stopping:
            targets = dict(self.lead.pools.targets)
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

    async def _recreate_mailbox(self, targets: dict[PoolKind, int]) -> None:
        """The mailbox died (killed, its node gone): make a new one under the same name, tell it what this
        lead knows, and have every replica (and this one, if it is a replica) find it again. Admin calls
        through the other replicas fail UNAVAILABLE meanwhile; elections wait for it."""
        from control.follower import FollowerServer  # (it imports this module)

        lead = self.lead
        mailbox = await create_mailbox(lead.shared.port)
        replicas = {r.index: r.router_id for r in self.replicas.values()}
        seen = [int(rid.rsplit(".", 1)[1]) for rid in [*replicas.values(), lead.router_id] if rid and "." in rid]
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
            rep.actor.add_worker.remote(worker.info)

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

    async def _release(self, worker: Worker, router_id: RouterId) -> int:
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
                return await rep.actor.drain_worker.remote(worker.worker_id, method, timeout_s)
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



def stop_deployment(port: int, grace_s: float, wait_s: float = 60.0) -> RouterId:
    """`pdserve stop`: ask the deployment with router replicas on `port` in the joined Ray cluster to drain
    (up to `grace_s`) and stop, and wait until it has. Returns the lead's router id (None for the serve
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
