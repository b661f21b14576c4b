"""`pdserve serve`'s deployment: the worker pools on Ray, the router over them and its doors (configured by
`control.config.ServeConfig`). `control.serve_loop` runs one until a signal; `control.ray_cluster` gives it
its Ray cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from control.admin import PoolAdmin
from control.admin_servicer import AdminServicer
from control.config import ServeConfig, kv_transfer_config
from control.console import ServeError, log
from control.doors import bind_grpc, grpc_door, http_server, metrics_endpoint, set_health
from control.launcher import ray_launcher
from engine.config import FP8_KV_DTYPES
from engine.hub import gguf_source, resolve_model
from engine.model_files import load_config, model_limits, tensor_parallel_refusal
from engine.tokenizer import Tokenizer
from protocol.kv_config import KVTransferConfig
from protocol.messages import RouterId
from protos.pdserve.v1 import admin_pb2_grpc
from router.door import Door
from router.http_api import HttpDoor, HttpServer
from router.metrics import Metrics
from router.metrics_export import MetricsEndpoint
from router.observer import RequestObserver
from router.pool import LivenessConfig, PoolManager
from router.registry import WorkerRegistry
from router.router import Router
from router.security import TLSConfig
from router.servicer import GenerationServicer
from router.stall_watch import StallWatch
from router.validation import Limits

logger = logging.getLogger("pdserve")


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
        self.autoscaler = None  # control.autoscale.Autoscale (`--autoscale`)

    async def start(self) -> None:
        """Open the doors (gRPC, metrics, HTTP; NOT_SERVING until the pools are up), start the pools and the
        router (and with `--routers N`, the other replicas), then serve."""
        c = self.config
        if c.routers > 1 and c.port and self.leading:  # (the other replicas join the lead's port)
            from control.shared import refuse_taken_port

            refuse_taken_port(c.port)  # before binding: SO_REUSEPORT would let this one take its connections
        path = resolve_model(c.model)  # download/convert once, here, before any worker looks for it
        try:
            # a family the built-in engine cannot run fails here, not in each worker in turn
            context, vocab_size = model_limits(path, builtin="builtin" in c.engines())
        except ValueError as e:
            raise ServeError(f"--model {c.model}: {e}") from e
        for kind in c.pool_kinds():  # vLLM refuses these in every worker, in a 50-line traceback each
            tp = c.pool_tensor_parallel_size(kind)
            why = tensor_parallel_refusal(path, tp) if tp > 1 else None
            if why is not None:
                raise ServeError(f"{c.tensor_parallel_flag(kind)} {tp}: --model {c.model}: {why}")
        if c.quantization == "gguf":  # (an HF directory: refused here, not in each worker in turn)
            try:
                gguf_source(c.model, path, c.quantization)
            except ValueError as e:
                raise ServeError(str(e)) from e
        if c.kv_cache_memory_bytes is not None and "builtin" in c.engines():
            least = smallest_kv_block_bytes(path, c)
            if c.kv_cache_memory_bytes < least:  # here, not in each worker in turn
                raise ServeError(f"--kv-cache-memory-bytes {c.kv_cache_memory_bytes} holds no KV block of "
                                 f"{c.model} ({least} bytes at the least); give it at least that")
        tokenizer = Tokenizer(path)
        max_model_len = min(c.max_model_len or context, context)
        limits = Limits(max_model_len=max_model_len, vocab_size=vocab_size)
        if c.autoscale is not None and self.metrics is not None:  # before any worker: a bad file stops it here
            from control.autoscale import Autoscale

            try:
                self.autoscaler = Autoscale(c.autoscale, self.metrics.registry, c)
            except ValueError as e:
                raise ServeError(f"--autoscale: {e}") from e
        tls = await self._open_doors(tokenizer, limits)
        await self._start_router()
        if self.autoscaler is not None:
            self.autoscaler.start(self.admin, asyncio.get_running_loop())
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

        self.admin_servicer = self._admin_servicer()
        self.grpc, self.health = grpc_door(keys, c.routers > 1, servicer, self.admin_servicer)
        try:
            tls = c.tls()
        except ValueError as e:
            raise ServeError(str(e)) from e
        self.port = bind_grpc(self.grpc, c, tls)
        await set_health(self.health, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        if self.metrics is not None and c.metrics_port is not None:
            try:
                self.metrics_endpoint = metrics_endpoint(self.metrics, c, self._metrics_labels())
            except ServeError:
                await self.grpc.stop(None)
                raise
            self.metrics_port = self.metrics_endpoint.port
            log(f"Prometheus metrics on http://{c.metrics_host or c.host}:{self.metrics_port}/metrics")

        if c.http_port is not None:
            self.http_door = HttpDoor(c.model, tokenizer, limits, observer, serving=lambda: self._serving,
                                      door=self.door)
            try:
                self.http = http_server(self.http_door, c, tls)
            except ServeError:
                await self.grpc.stop(None)
                raise
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
            self.shared, store = await start_shared(c, self.port, lease_s)
            kv_config = self.shared.kv_config
        else:
            kv_config = self._kv_config()
            store = self.rendezvous
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
        await self._start_pools(store, kv_config)
        self._tasks.append(asyncio.ensure_future(self.pools.maintain()))
        self.admin = self.admin_servicer.admin = PoolAdmin(self.router, self.pools)
        self.admin_runner = self.admin_servicer
        if replicated:
            self.replicas = ReplicaSet(self, c.routers - 1)
            self.pools.authority = self.replicas.leads
            self.admin.drain_elsewhere = self.replicas.drain_worker
            log(f"starting {c.routers - 1} more router replica(s) on port {self.port}...")
            await self.replicas.start()

    async def _start_pools(self, store: Any, kv_config: KVTransferConfig | None) -> None:
        """The pools, while the rendezvous store's actor `store` (None: no store) starts: a store that did
        not start fails the start, naming it, instead of leaving the workers waiting for it."""
        if store is None or kv_config is None:
            await self.pools.start()
            return
        from control.shared import store_up

        assert kv_config.rendezvous_host is not None and kv_config.rendezvous_port is not None
        up = asyncio.ensure_future(store_up(store, (kv_config.rendezvous_host, kv_config.rendezvous_port)))
        pools = asyncio.ensure_future(self.pools.start())
        await asyncio.wait({up, pools}, return_when=asyncio.FIRST_EXCEPTION)
        if up.done() and up.exception() is not None:
            pools.cancel()
            with contextlib.suppress(BaseException):
                await pools
        await asyncio.gather(up, pools)

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
                await set_health(self.health, status)
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
            await set_health(self.health, health_pb2.HealthCheckResponse.NOT_SERVING)
            n = len(self.router.requests)
            log(f"shutting down: waiting up to {grace:.0f}s for {n} request(s) in flight")
            # every replica drains its own streams, at the same time
            others = self.replicas.shutdown(grace) if self.replicas is not None else asyncio.sleep(0)
            drained, _ = await asyncio.gather(self.router.drain(grace), others)
            if not drained:
                log(f"shutting down: {len(self.router.requests)} request(s) still in flight after {grace:.0f}s; "
                    "ending them")
        await self.stop()

    def _kv_config(self) -> KVTransferConfig | None:
        """One router: the rendezvous store (if any) lives in an actor on this node, which ends with this
        process (the serve process never loads torch: the store is a torch.distributed TCPStore)."""
        store = None
        if self.config.needs_rendezvous:
            from control.shared import start_rendezvous

            # NOTE: the store must be reachable from every worker's node: it binds this node's Ray address.
            self.rendezvous, store = start_rendezvous()
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
        if self.autoscaler is not None:  # first: no scale may start while the pools stop
            await asyncio.to_thread(self.autoscaler.stop)
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


def smallest_kv_block_bytes(path: Any, c: ServeConfig) -> int:
    """The fewest bytes a built-in engine's KV block of this deployment can take: in the cache's dtype, else
    the model's, else bfloat16 (a GPU worker's default, the narrowest one a worker may pick by itself)."""
    m = load_config(path)
    name = c.kv_cache_dtype or c.dtype or "bfloat16"
    size = 1 if name in FP8_KV_DTYPES else 4 if name == "float32" else 2
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * c.kv_block_size * size
