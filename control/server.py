"""`pdserve serve`: a Ray cluster (joined or started on loopback), the worker pools, and the gRPC server
(configured by `control.config.ServeConfig`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control.admin import PoolAdmin
from control.admin_servicer import AdminServicer
from control.config import ServeConfig, kv_transfer_config
from control.launcher import ray_launcher
from engine.hub import resolve_model
from engine.model_files import model_limits
from engine.tokenizer import Tokenizer
from protocol.kv_config import KVTransferConfig
from protocol.messages import RouterId
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.door import Door
from router.http_api import HttpDoor, HttpServer
from router.metrics import Metrics, MetricsEndpoint
from router.observer import RequestObserver
from router.pool import LivenessConfig, PoolManager
from router.registry import WorkerRegistry
from router.router import Router
from router.security import ApiKeyInterceptor, TLSConfig
from router.servicer import GenerationServicer
from router.stall_watch import StallWatch
from router.validation import Limits
from router.wire import add_parsing_safely

logger = logging.getLogger("pdserve")
SERVICE = "pdserve.v1.Generation"
# of the shutdown grace, what is kept back from the drain for stopping the workers and the Ray cluster
_STOP_RESERVE_S = 8.0


class ServeError(RuntimeError):
    """The deployment cannot start (a port taken, ...); the message says what to change."""


class Server:
    """One running deployment: Ray pools, router, gRPC server. `start()`, then `stop()`."""

    def __init__(self, config: ServeConfig, observer: RequestObserver | None = None) -> None:
        """`observer` replaces the server's own `Metrics` (made when config.metrics_port is set); the
        `/metrics` endpoint serves it when it is a `Metrics`."""
        self.config = config
        if observer is None and config.metrics_port is not None:
            observer = Metrics(config.model)
        self.observer = observer
        self.metrics = observer if isinstance(observer, Metrics) else None
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.metrics_port: int | None = None  # the bound port once started (config.metrics_port may be 0)
        self.grpc: grpc.aio.Server | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None  # the bound port once started
        self.router: Router | None = None
        self.replicas = None  # control.replica_set.ReplicaSet: the other router replicas (`--routers N`)
        self.reports_pools = True  # the lead reports pool sizes; other replicas only follow them
        self.leading = True  # holds the pools: starts, replaces and stops the workers
        self.router_id: RouterId = None  # this router's attempt-key prefix (None: the serve process, no prefix)
        self.index = 0  # its replica index (`--routers N`: its metrics' `router` label)
        # the KV rendezvous store's host actor, on this node (one router; replicas: `shared`'s, detached),
        # and where the store listens
        self.rendezvous = None
        self.rendezvous_address: tuple[str, int] | None = None
        self.shared = None  # control.shared.Shared: what another replica needs to take the pools over
        self.admin_runner: AdminServicer | None = None  # runs Admin calls on the pools (the lead's)
        self.stopped = asyncio.Event()  # set once `stop` has run
        self.port = config.port
        self._tasks: list[asyncio.Task] = []
        self._exit: asyncio.Task | None = None  # a stop this server started itself (`pdserve stop`, deposed)
        self._stopped = False
        self._serving = False
        self._launched: dict[str, Any] = {}  # worker id -> its Ray actor, from creation on (lead, one router)

    async def start(self) -> None:
        """Open the doors (gRPC, metrics, HTTP; NOT_SERVING until the pools are up), start the pools and the
        router (and with `--routers N`, the other replicas), then serve."""
        c = self.config
        if c.routers > 1 and c.port and self.leading:  # (the other replicas join the lead's port)
            from control.shared import refuse_taken_port

            refuse_taken_port(c.port)  # before binding: SO_REUSEPORT would let this one take its connections
        path = resolve_model(c.model)  # download/convert once, here, before any worker looks for it
        context, vocab_size = model_limits(path)
        tokenizer = Tokenizer(path)
        max_model_len = min(c.max_model_len or context, context)
        limits = Limits(max_model_len=max_model_len, vocab_size=vocab_size)
        tls = await self._open_doors(tokenizer, limits)
        await self._start_router()
        self.servicer.router = self.router
        if self.http is not None:
            self.http_door.router = self.router
        self._tasks.append(asyncio.ensure_future(self._watch_health()))
        door = ("mutual TLS" if tls.client_ca else "TLS") if tls is not None else "plaintext"
        log(f"serving {c.model} on {c.host}:{self.port} ({door}, "
            f"{'API key required' if c.api_key or c.api_keys else 'no API key'})")

    def _admin_servicer(self) -> admin_pb2_grpc.AdminServicer:
        return AdminServicer()

    async def _open_doors(self, tokenizer: Tokenizer, limits: Limits) -> TLSConfig | None:
        c = self.config
        try:
            keys = c.key_table()
        except ValueError as e:
            raise ServeError(str(e)) from e
        observer = self.observer or RequestObserver()
        # one door for both: a tenant's quotas count its requests on either
        self.door = Door(limits, tokenizer, keys, StallWatch(c.stalled_stream_timeout, observer.on_stalled_stream))
        servicer = GenerationServicer(c.model, tokenizer, limits, c.kv_block_size, self.observer, self.door)
        self.servicer = servicer

        # NOTE: gRPC sets SO_REUSEPORT by default, which would let a second deployment bind a taken port and
        # silently take half its connections: only router replicas share a port
        self.grpc = grpc.aio.server(interceptors=[ApiKeyInterceptor(keys)] if keys is not None else None,
                                    options=[("grpc.so_reuseport", 1 if c.routers > 1 else 0)])
        add_parsing_safely(pb_grpc.add_GenerationServicer_to_server, servicer, self.grpc)
        # NOTE: the operator API shares the port, so the API key and TLS guard it exactly as they guard
        # generation: there is no unprotected side door
        self.admin_servicer = self._admin_servicer()
        add_parsing_safely(admin_pb2_grpc.add_AdminServicer_to_server, self.admin_servicer, self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME), self.grpc)
        try:
            tls = c.tls()
        except ValueError as e:
            raise ServeError(str(e)) from e
        try:
            if tls is not None:
                self.port = self.grpc.add_secure_port(f"{c.host}:{c.port}", tls.server_credentials())
            else:
                self.port = self.grpc.add_insecure_port(f"{c.host}:{c.port}")
        except RuntimeError as e:
            raise ServeError(f"cannot listen on {c.host}:{c.port} ({e}); is the port taken? "
                             "Pass another --port.") from e
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        if self.metrics is not None and c.metrics_port is not None:
            try:
                self.metrics_endpoint = MetricsEndpoint(self.metrics.registry, c.metrics_host or c.host,
                                                        c.metrics_port, self._metrics_labels())
            except OSError as e:
                await self.grpc.stop(None)
                raise ServeError(f"cannot serve metrics on {c.host}:{c.metrics_port} ({e}); is the "
                                 "port taken? Pass another --metrics-port (0: any free port).") from e
            self.metrics_port = self.metrics_endpoint.port
            log(f"Prometheus metrics on http://{c.metrics_host or c.host}:{self.metrics_port}/metrics")

        if c.http_port is not None:
            self.http_door = HttpDoor(c.model, tokenizer, limits, observer, serving=lambda: self._serving,
                                      door=self.door)
            try:
                self.http = HttpServer(self.http_door, c.host, c.http_port, tls, reuse_port=c.routers > 1,
                                       header_timeout_s=c.http_header_timeout)
            except OSError as e:
                await self.grpc.stop(None)
                raise ServeError(f"cannot serve HTTP on {c.host}:{c.http_port} ({e}); is the port taken, or the "
                                 "TLS certificate unreadable? Pass another --http-port (0: off).") from e
            self.http_port = self.http.port
            self.http.start()
            log(f"OpenAI-compatible HTTP on http{'s' if tls else ''}://{c.host}:{self.http_port}/v1")
        return tls

    def _metrics_labels(self) -> dict[str, str]:
        # NOTE: one series per replica (a bounded label: replica indexes 0..N-1, a replacement keeps its
        # predecessor's), so Prometheus sums them; a lone router adds no label
        return {"router": "0"} if self.config.routers > 1 else {}

    async def _start_router(self) -> None:
        """The lead: the Ray pools, the router over them, the pool admin, and the other router replicas."""
        c = self.config
        # NOTE: a lease outlives several missed renewals: only a prefill worker declared dead (or a router
        # gone) lets it lapse
        lease_s = max(30.0, 3 * c.worker_timeout)
        replicated = c.routers > 1
        if replicated:
            from control.replica_set import ReplicaSet
            from control.shared import start_shared

            # NOTE: with replicas, the workers, the replicas and the KV rendezvous store outlive this process:
            # when it dies, another replica takes the pools over (control.replica_set)
            self.shared = await start_shared(c, self.port, lease_s)
            kv_config = self.shared.kv_config
        else:
            kv_config = await self._kv_config()
        log(f"starting {c.num_workers} workers for {c.model} "
            f"({c.prefill_workers} prefill, {c.decode_workers} decode, {c.colocated_workers} colocated)...")
        self.registry = WorkerRegistry()
        self.router = Router(c.router_config(), self.registry, observer=self.observer)
        launch = (self.shared.launcher(self.router_id) if replicated
                  else ray_launcher(kv_config, lease_s, on_launch=self._on_launch))
        self.pools = PoolManager(c.pool_specs(), self.registry, launch,
                                 LivenessConfig(worker_timeout_s=c.worker_timeout),
                                 on_report=self.router.apply_report, on_heartbeat=self.router.on_heartbeat,
                                 cache_cursor=self.router.cache_cursor, max_workers=c.max_pool_size)
        await self.pools.start()
        self._tasks.append(asyncio.ensure_future(self.pools.maintain()))
        self.admin = self.admin_servicer.admin = PoolAdmin(self.router, self.pools)
        self.admin_runner = self.admin_servicer
        if replicated:
            self.replicas = ReplicaSet(self, c.routers - 1)
            self.pools.authority = self.replicas.leads
            self.admin.drain_elsewhere = self.replicas.drain_worker
            log(f"starting {c.routers - 1} more router replica(s) on port {self.port}...")
            await self.replicas.start()

    def _on_launch(self, worker_id: str, actor: Any) -> None:
        """Every worker actor as soon as it is created: a stop must reach it even before it is ready."""
        self._launched[worker_id] = actor
        if self._stopped:  # launched while stopping (a start that was under way)
            self.kill_workers_now()

    def kill_workers_now(self) -> None:
        """End every worker actor this server started, at once, ready or still loading its model (a signal
        during start-up; a stop past its deadline). Their pending calls fail, which ends a start under way."""
        import ray

        if not self.leading:  # deposed: the workers are the new lead's
            return
        for actor in self._launched.values():
            with contextlib.suppress(Exception):  # already dead, or Ray is going down
                ray.kill(actor, no_restart=True)

    async def _watch_health(self) -> None:
        """SERVING while every pool has a live worker and the server admits requests; NOT_SERVING else."""
        serving = None
        while True:
            empty = []
            for spec in self.pools.specs:
                live = len(self.pools.live(spec.kind))
                target = self.pools.targets[spec.kind]
                if self.observer is not None and self.reports_pools:
                    self.observer.on_pool_size(spec.kind.value, live, target, self.pools.backoff_left(spec.kind))
                if not live and target:
                    empty.append(spec.kind.value)
            now = not empty and not self.router.draining
            self._serving = now
            if now != serving:
                status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", SERVICE):
                    await self.health.set(name, status)
                if serving is not None:
                    log("health: SERVING" if now else
                        f"health: NOT_SERVING ({'draining' if self.router.draining else 'no live worker in the ' + ', '.join(empty) + ' pool'})")
                serving = now
            await asyncio.sleep(0.2)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Graceful stop: admit nothing more (health NOT_SERVING), let in-flight requests finish within
        `grace_s` (default: the config's shutdown_grace), then stop everything."""
        grace = self.config.shutdown_grace if grace_s is None else grace_s
        if self.router is not None:
            self.router.draining = True
            self._serving = False
            for name in ("", SERVICE):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            n = len(self.router.requests)
            log(f"shutting down: waiting up to {grace:.0f}s for {n} request(s) in flight")
            # every replica drains its own streams, at the same time
            others = self.replicas.shutdown(grace) if self.replicas is not None else asyncio.sleep(0)
            drained, _ = await asyncio.gather(self.router.drain(grace), others)
            if not drained:
                log(f"shutting down: {len(self.router.requests)} request(s) still in flight after {grace:.0f}s; "
                    "ending them")
        await self.stop()

    async def _kv_config(self) -> KVTransferConfig | None:
        """One router: the rendezvous store (if any) lives in an actor on this node, which ends with this
        process (the serve process never loads torch: the store is a torch.distributed TCPStore)."""
        store = None
        if self.config.needs_rendezvous:
            from control.shared import start_rendezvous

            # NOTE: the store must be reachable from every worker's node: it binds this node's Ray address.
            self.rendezvous, store = await start_rendezvous()
            self.rendezvous_address = store
        return kv_transfer_config(self.config, store)

    async def stop(self) -> None:
        """Stop serving; the lead also stops every worker and replica. A lead another replica replaced
        (`deposed`) leaves them running: they are the new lead's."""
        if self._stopped:
            await self.stopped.wait()  # a second caller returns once the first one's stop is done
            return
        self._stopped = True
        try:
            await self._stop()
        finally:
            self.stopped.set()

    async def _stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.grpc is not None:
            await self.grpc.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.replicas is not None:
            await self.replicas.stop(everything=self.leading)
        if self.router is not None:
            await self.pools.close()
            await self.router.close()
            if self.leading:
                await self._stop_workers()
        if self.rendezvous is not None:  # after the workers: they hold clients of it
            import ray

            with contextlib.suppress(Exception):
                ray.kill(self.rendezvous)
        if self.shared is not None and self.leading:
            await self.shared.close(keep=None if self.router_id is None else f"router-{self.router_id}")
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()

    def stop_requested(self, grace_s: float) -> None:
        """`pdserve stop` reached the lead: drain every replica within `grace_s`, then stop everything."""
        log(f"the deployment was asked to stop (pdserve stop); draining for up to {grace_s:.0f}s")
        self._exit = asyncio.ensure_future(self._stop_and_exit(grace_s))  # (not in _tasks: stop cancels those)

    def deposed(self, by: str) -> None:
        """Another replica took the pools over while this lead was silent (stopped, cut off): stop serving
        at once, and leave the workers and replicas to it."""
        if self._stopped:
            return
        log(f"router replica {by} took the pools over while this lead was silent; stopping (the deployment "
            "serves on without this process)")
        self.leading = False
        self._exit = asyncio.ensure_future(self._stop_and_exit(None))

    async def _stop_and_exit(self, grace_s: float | None) -> None:
        """Drain for `grace_s` (None: stop at once), stop, and end this process's part (see FollowerServer)."""
        if grace_s is not None:
            await self.shutdown(grace_s)
        await self.stop()


    async def _stop_workers(self) -> None:
        workers = list(self.registry.workers.values())
        # let each worker close its KV links cleanly before the processes go
        with contextlib.suppress(asyncio.TimeoutError):  # dead workers answer with errors, kept quiet
            await asyncio.wait_for(asyncio.gather(*(w.client.shutdown(10) for w in workers if w.alive),
                                                  return_exceptions=True), timeout=10)
        for w in workers:
            with contextlib.suppress(Exception):
                w.client.kill()


def pin_ray_to_loopback() -> None:
    """Make a Ray cluster started by this process live on 127.0.0.1. Call before `import ray`.

    NOTE: `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray "resolves" a loopback address
    to the machine's routable IP unless its single-machine mode is on, which this variable turns on.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # NOTE: Ray starts workers at nice 15, so any ordinary process on the box steals their CPU; the model
    # replicas are the point of this machine.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def init_ray(address: str | None, num_workers: int) -> None:
    """Join the Ray cluster at `address` ("auto" or HOST:PORT), or start this process's own single-machine
    cluster on 127.0.0.1 when it is None; the log says which."""
    if address is None:
        pin_ray_to_loopback()
    import ray

    if ray.is_initialized():
        return
    if address:
        ctx = ray.init(address=address)
        log(f"joined the Ray cluster at {ctx.address_info.get('gcs_address', address)} "
            f"({len([n for n in ray.nodes() if n['Alive']])} nodes)")
    else:
        # NOTE: address="local" starts a new cluster even when Ray has one registered as this machine's
        # current cluster (`ray_current_cluster` in Ray's temp dir, left by `ray start` or a test session):
        # without it ray.init joins that one, and refuses num_cpus.
        ctx = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                       num_cpus=max(os.cpu_count() or 1, num_workers), log_to_driver=True)
        log(f"started a new single-machine Ray cluster at {ctx.address_info.get('gcs_address')} "
            "(pass --ray-address to join an existing one)")


def log(msg: str) -> None:
    print(f"pdserve: {msg}", file=sys.stderr, flush=True)


async def serve_forever(config: ServeConfig) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully (see `Server.shutdown`), all within
    `config.shutdown_grace` of the signal, start-up included: a signal while the workers load kills them."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signalled_at: list[float] = []  # loop time of the first signal

    def on_signal() -> None:
        if not signalled_at:
            signalled_at.append(loop.time())
        stop.set()

    init_ray(config.ray_address, config.num_workers)
    # NOTE: after `init_ray`: Ray installs its own SIGTERM handler (it dumps a stack and dies) in `ray.init`
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    server = Server(config)
    signalled = asyncio.ensure_future(stop.wait())

    def deadline() -> float:
        return signalled_at[0] + config.shutdown_grace if signalled_at else loop.time() + _STOP_RESERVE_S

    try:
        if await _start_unless_signalled(server, signalled):
            await asyncio.wait([signalled, asyncio.ensure_future(server.stopped.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            if signalled.done():
                log("signal received: draining")
                await _stop_by(server.shutdown(_drain_budget(config.shutdown_grace)), server, deadline())
    finally:
        # idempotent: a no-op after a graceful shutdown; stops a failed or interrupted start
        await _stop_by(server.stop(), server, deadline())
        signalled.cancel()


async def _start_unless_signalled(server: Server, signalled: asyncio.Future) -> bool:
    """Start `server`; True once it serves. A signal first: kill the workers being started and say False.

    NOTE: a start waits for every worker to load its model (a minute for 1P+2D on this 2-core machine), and
    the pool manager lets every worker start run to its end even when its start is cancelled: killing the
    actors is what makes those starts end now."""
    starting = asyncio.ensure_future(server.start())
    await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a failed start raises here (ServeError: the message says what to change)
        return True
    log("signal received during start-up: stopping the workers being started")
    server.kill_workers_now()
    starting.cancel()
    with contextlib.suppress(BaseException):  # cancelled, or failed as its workers died: either is expected
        await asyncio.wait_for(starting, _STOP_RESERVE_S)
    return False


async def _stop_by(stopping: Coroutine[Any, Any, None], server: Server, deadline: float) -> None:
    """Run `stopping` (the server's shutdown or stop) until `deadline` (loop time, less a second for the Ray
    cluster to go down); past it, or after it, kill the workers the server started."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(stopping, max(0.0, deadline - loop.time() - 1.0))
    except asyncio.TimeoutError:
        log("shutting down: stopping took past the shutdown grace; killing the workers")
    server.kill_workers_now()  # (no-op for workers the stop ended; catches any launched while it ran)


def _drain_budget(grace_s: float) -> float:
    """Of the shutdown grace, how long in-flight requests may take: the rest stops the workers and Ray."""
    return max(0.0, grace_s - min(_STOP_RESERVE_S, grace_s / 2))
