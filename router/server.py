"""`pdserve serve`: a Ray cluster (joined or started on loopback), the worker pools, and the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.hub import resolve_model
from engine.loader import load_config
from engine.tokenizer import Tokenizer
from protocol import PoolKind
from protocol.node import node_identity
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.admin import PoolAdmin
from router.admin_servicer import AdminServicer
from router.cost_model import CostPriors
from router.http_api import HttpDoor, HttpServer
from router.metrics import Metrics, MetricsEndpoint
from router.observer import RequestObserver
from router.pool import LivenessConfig, PoolManager, PoolSpec, WorkerRegistry, ray_launcher
from router.router import Router, RouterConfig
from router.security import ApiKeyInterceptor, TLSConfig
from router.servicer import GenerationServicer
from router.validation import Limits
from router.wire import add_parsing_safely

logger = logging.getLogger("pdserve")
SERVICE = "pdserve.v1.Generation"


@dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 50051
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 0
    ray_address: str | None = None  # None -> start a single-machine Ray cluster pinned to 127.0.0.1
    prefill_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    decode_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    kv_transport: str = "torch"
    routing: str = "prefix"
    worker_threads: int | None = None  # torch threads per worker; None -> this machine's cores / workers
    max_model_len: int | None = None
    num_blocks: int | None = None  # KV blocks per worker; None -> a share of free memory
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # decode/colocated step budget
    prefill_max_num_batched_tokens: int = 2048  # prefill pool step budget (fair order: the chunk cap below)
    prefill_order: str = "fair"  # prompts by fewest uncomputed tokens, aged ("fifo": by arrival)
    prefill_chunk_tokens: int = 256  # fair order: the most prompt tokens a step computes, all prompts (0: budget)
    # the same on decode workers (local prefills): small, so a prompt computed there stalls its streams by
    # about one decode step at a time, not by the whole prompt at once (Sarathi-Serve's stall-free batching)
    decode_prefill_chunk_tokens: int = 64
    # the router's cost model's stand-ins and measurement floor (no flag: the defaults learn from measurements)
    cost_priors: CostPriors = field(default_factory=CostPriors)
    max_queue: int = 256  # requests waiting for KV room before RESOURCE_EXHAUSTED
    admission_timeout_s: float = 60.0  # a request waits this long for KV room or a live worker
    max_queued_prefill_tokens: int = 65536  # per prefill worker, before RESOURCE_EXHAUSTED
    migration_limit: int = 3  # re-placements per request after a worker loss or a failed transfer
    worker_timeout: float = 10.0  # no heartbeat, or no engine progress with work to do, this long: dead
    shutdown_grace: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    verify_kv_moves: bool = False  # check every drained sequence's moved KV against its source (SHA-256)
    placement: str = "joint"  # "joint": the (prefill, decode) pair or the decode worker alone, by cost
    local_prefill: bool = False  # joint placement may prefill a prompt on its decode worker when cheaper
    # a long prompt's decode blocks are reserved as its prefill nears the end, not while it queues
    late_reservation: bool = True
    metrics_port: int | None = 9400  # Prometheus /metrics; None -> no metrics endpoint, 0 -> any free port
    metrics_host: str | None = None  # where /metrics binds; None -> --host (scrape it from inside only)
    http_port: int | None = None  # the OpenAI-compatible HTTP door; None -> off, 0 -> any free port
    # (`pdserve serve` turns it on at 8000)
    device: str | None = None
    dtype: str | None = None
    speculative: str | None = None  # decode and colocated workers: None (off) or "ngram"
    num_speculative_tokens: int = 8  # the most drafts verified per sequence per step
    max_draft_tokens_per_step: int = 32  # the most drafts one step verifies, shared by its sequences (0: no cap)
    tls_cert: str | None = None  # PEM: serve gRPC over TLS with this certificate chain ...
    tls_key: str | None = None  # ... and private key
    tls_client_ca: str | None = None  # mutual TLS: clients must present a certificate this CA signed
    api_key: str | None = field(default=None, repr=False)  # every call but health needs "Bearer <key>"
    routers: int = 1  # router replicas sharing --port (and --http-port) over the same pools
    routers_spread: bool = False  # place the other replicas over the nodes, not on this one
    max_pool_size: int = 64  # the most workers `pdserve scale` may ask of one pool

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "colocated_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.colocated_workers and (self.prefill_workers or self.decode_workers):
            raise ValueError("--colocated-workers cannot be mixed with --prefill-workers/--decode-workers; "
                             "pass --prefill-workers 0 --decode-workers 0")
        if not self.colocated_workers and not (self.prefill_workers and self.decode_workers):
            raise ValueError("need at least one prefill and one decode worker (or --colocated-workers N)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: pass both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")
        if self.worker_timeout <= 0.5:
            raise ValueError(f"--worker-timeout must be > 0.5 seconds (the heartbeat interval), got "
                             f"{self.worker_timeout}")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"--speculative must be ngram (or absent), got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.max_draft_tokens_per_step < 0:
            raise ValueError(f"--max-draft-tokens-per-step must be >= 0 (0: no cap), got "
                             f"{self.max_draft_tokens_per_step}")
        if self.prefill_order not in ("fair", "fifo"):
            raise ValueError(f"--prefill-order must be fair or fifo, got {self.prefill_order!r}")
        if self.decode_prefill_chunk_tokens < 0:
            raise ValueError("--decode-prefill-chunk-tokens must be >= 0 (0: the whole step budget), got "
                             f"{self.decode_prefill_chunk_tokens}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"--prefill-chunk-tokens must be >= 0 (0: the whole step budget), got "
                             f"{self.prefill_chunk_tokens}")
        if self.routers < 1:
            raise ValueError(f"--routers must be >= 1, got {self.routers}")
        if self.max_pool_size < max(1, self.prefill_workers, self.decode_workers, self.colocated_workers):
            raise ValueError(f"--max-pool-size must be >= 1 and hold every pool's starting size, got "
                             f"{self.max_pool_size}")
        if self.shutdown_grace < 0:
            raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {self.shutdown_grace}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if self.metrics_port is not None:
            if not 0 <= self.metrics_port < 65536:
                raise ValueError(f"--metrics-port must be in 0..65535 (0: any free port), got {self.metrics_port}")
            if self.metrics_port == self.port != 0:
                raise ValueError(f"--metrics-port and --port are both {self.port}; give them different ports")
        if self.http_port is not None:
            if not 0 <= self.http_port < 65536:
                raise ValueError(f"--http-port must be in 1..65535 (0: off), got {self.http_port}")
            if self.http_port != 0 and self.http_port in (self.port, self.metrics_port):
                raise ValueError(f"--http-port {self.http_port} is also --port or --metrics-port; give it its own")

    @property
    def needs_rendezvous(self) -> bool:
        """Whether the workers' KV links meet at a rendezvous store (torch.distributed between pools)."""
        return not self.colocated_workers and self.kv_transport == "torch"

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers + self.colocated_workers

    def engine_config(self, budget: int, decodes: bool = True, chunk: int | None = None) -> EngineConfig:
        """A worker's engine; `decodes`: it runs decode steps (so speculation applies to it); `chunk`: its
        prompt tokens per step (default --prefill-chunk-tokens)."""
        threads = self.worker_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        spec = (SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.max_draft_tokens_per_step)
                if decodes else SpeculativeConfig())
        return EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                            max_model_len=self.max_model_len, num_threads=threads,
                            cache=CacheConfig(self.block_size, self.num_blocks),
                            scheduler=SchedulerConfig(self.max_num_seqs, budget, prefill_order=self.prefill_order,
                                                      prefill_chunk_tokens=self.prefill_chunk_tokens
                                                      if chunk is None else chunk),
                            speculative=spec)

    def tls(self) -> TLSConfig | None:
        """The TLS files, checked to exist (ValueError naming the flag): at start, not at parse time, so a
        deploy file's command parses anywhere."""
        if self.tls_cert is None:
            return None
        return TLSConfig(Path(self.tls_cert), Path(self.tls_key),
                         Path(self.tls_client_ca) if self.tls_client_ca else None)

    def router_config(self, router_id: str = "") -> RouterConfig:
        return RouterConfig(self.block_size, self.routing, self.max_queue, self.admission_timeout_s,
                            self.max_queued_prefill_tokens, self.migration_limit,
                            call_timeout_s=self.worker_timeout, verify_kv_moves=self.verify_kv_moves,
                            placement=self.placement, local_prefill=self.local_prefill, router_id=router_id,
                            # (the engine caps prompt tokens per step in fair order only)
                            local_chunk_tokens=self.decode_prefill_chunk_tokens if self.prefill_order == "fair"
                            else 0, cost_priors=self.cost_priors, late_reservation=self.late_reservation,
                            promise_share=1 / self.routers)

    def pool_specs(self) -> list[PoolSpec]:
        if self.colocated_workers:
            return [PoolSpec(PoolKind.COLOCATED, self.colocated_workers,
                             self.engine_config(self.max_num_batched_tokens), self.decode_resources)]
        return [PoolSpec(PoolKind.PREFILL, self.prefill_workers,
                         self.engine_config(self.prefill_max_num_batched_tokens, decodes=False),
                         self.prefill_resources),
                PoolSpec(PoolKind.DECODE, self.decode_workers,
                         self.engine_config(self.max_num_batched_tokens, chunk=self.decode_prefill_chunk_tokens),
                         self.decode_resources)]


def kv_transfer_config(config: ServeConfig, store: tuple[str, int] | None):
    """The workers' KV transfer: None for colocated pools, the Ray object store, or torch.distributed links
    meeting at the rendezvous `store` (host, port; needed when `config.needs_rendezvous`)."""
    from kv_transfer import KVTransferConfig

    if config.colocated_workers:
        return None
    if not config.needs_rendezvous:
        return KVTransferConfig(kv_transport=config.kv_transport)
    host, port = store
    # NOTE: a fresh secret per deployment, handed to the workers inside this config (through Ray, over the
    # cluster network the threat model trusts): every link request in the store must carry its MAC
    return KVTransferConfig(kv_transport="torch", rendezvous_host=host, rendezvous_port=port,
                            secret=secrets.token_hex(32))


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
        self.replicas = None  # router.replicas.ReplicaSet: the other router replicas (`--routers N`)
        self.reports_pools = True  # the lead reports pool sizes; other replicas only follow them
        self.leading = True  # holds the pools: starts, replaces and stops the workers
        self.router_id = ""  # this router's attempt-key prefix ("": the serve process's)
        self.index = 0  # its replica index (`--routers N`: its metrics' `router` label)
        self.rendezvous = None  # the KV rendezvous store, in this process (one router)
        self.shared = None  # router.replicas.Shared: what another replica needs to take the pools over
        self.admin_runner: AdminServicer | None = None  # runs Admin calls on the pools (the lead's)
        self.stopped = asyncio.Event()  # set once `stop` has run
        self.port = config.port
        self._tasks: list[asyncio.Task] = []
        self._exit: asyncio.Task | None = None  # a stop this server started itself (`pdserve stop`, deposed)
        self._stopped = False
        self._serving = False

    async def start(self) -> None:
        """Open the doors (gRPC, metrics, HTTP; NOT_SERVING until the pools are up), start the pools and the
        router (and with `--routers N`, the other replicas), then serve."""
        c = self.config
        if c.routers > 1 and c.port and self.leading:  # (the other replicas join the lead's port)
            from router.replicas import refuse_taken_port

            refuse_taken_port(c.port)  # before binding: SO_REUSEPORT would let this one take its connections
        path = resolve_model(c.model)  # download/convert once, here, before any worker looks for it
        model = load_config(path)
        tokenizer = Tokenizer(path)
        max_model_len = min(c.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
        limits = Limits(max_model_len=max_model_len, vocab_size=model.vocab_size)
        tls = await self._open_doors(tokenizer, limits)
        await self._start_router()
        self.servicer.router = self.router
        if self.http is not None:
            self.http_door.router = self.router
        self._tasks.append(asyncio.ensure_future(self._watch_health()))
        door = ("mutual TLS" if tls.client_ca else "TLS") if tls is not None else "plaintext"
        log(f"serving {c.model} on {c.host}:{self.port} ({door}, "
            f"{'API key required' if c.api_key else 'no API key'})")

    def _admin_servicer(self) -> admin_pb2_grpc.AdminServicer:
        return AdminServicer()

    async def _open_doors(self, tokenizer: Tokenizer, limits: Limits) -> TLSConfig | None:
        c = self.config
        servicer = GenerationServicer(c.model, tokenizer, limits, c.block_size, self.observer)
        self.servicer = servicer

        # NOTE: gRPC sets SO_REUSEPORT by default, which would let a second deployment bind a taken port and
        # silently take half its connections: only router replicas share a port
        self.grpc = grpc.aio.server(interceptors=[ApiKeyInterceptor(c.api_key)] if c.api_key else None,
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
            self.http_door = HttpDoor(c.model, tokenizer, limits, self.observer or RequestObserver(), c.api_key,
                                      serving=lambda: self._serving)
            try:
                self.http = HttpServer(self.http_door, c.host, c.http_port, tls, reuse_port=c.routers > 1)
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
            from router.replicas import ReplicaSet, start_shared

            # NOTE: with replicas, the workers, the replicas and the KV rendezvous store outlive this process:
            # when it dies, another replica takes the pools over (router.replicas)
            self.shared = await start_shared(c, self.port, lease_s)
            kv_config = self.shared.kv_config
        else:
            kv_config = self._kv_config()
        log(f"starting {c.num_workers} workers for {c.model} "
            f"({c.prefill_workers} prefill, {c.decode_workers} decode, {c.colocated_workers} colocated)...")
        self.registry = WorkerRegistry()
        self.router = Router(c.router_config(), self.registry, observer=self.observer)
        launch = self.shared.launcher(self.router_id) if replicated else ray_launcher(kv_config, lease_s)
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

    def _kv_config(self):
        """One router: the rendezvous store (if any) lives in this process."""
        store = None
        if self.config.needs_rendezvous:
            from kv_transfer import RendezvousServer

            # NOTE: the store must be reachable from every worker's node: bind it to this node's Ray address.
            self.rendezvous = RendezvousServer(node_identity()[1], 0)
            store = (self.rendezvous.host, self.rendezvous.port)
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
            self.rendezvous.close()
        if self.shared is not None and self.leading:
            await self.shared.close(keep=f"router-{self.router_id}")
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
    """Serve until SIGTERM or SIGINT, then stop gracefully (see `Server.shutdown`)."""
    init_ray(config.ray_address, config.num_workers)
    server = Server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()  # (a failed start is stopped below: nothing it started is left running)
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait([signalled, asyncio.ensure_future(server.stopped.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if signalled.done():
            log("signal received: draining")
            await server.shutdown()
    finally:
        await server.stop()  # idempotent: a no-op after a graceful shutdown
