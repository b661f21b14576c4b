"""`pdserve serve`'s configuration (`ServeConfig`, what its flags set) and what it derives: each pool's
engine, the router's config, the workers' KV transfer."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import (
    BACKENDS,
    DEFAULT_BLOCK_SIZE,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from protocol import PoolKind
from protocol.kv_config import KVTransferConfig
from protocol.messages import RouterId
from router.cost_model import CostPriors
from router.pool import PoolSpec
from router.router import RouterConfig
from router.security import TLSConfig
from router.tenants import ANONYMOUS, KeyTable


@dataclass(frozen=True)
class AutoscaleConfig:
    """`pdserve serve --autoscale SLO-FILE --autoscale-profile PROFILE`: the planner's watch loop, run by the
    serve process over its own pools (`pdserve plan watch --apply`'s loop; docs/planner.md)."""

    slo_file: str  # {"ttft_s": S, "itl_s": S, "target": 0.9}
    profile: str  # `pdserve plan profile`'s JSON, taken on this machine and model
    interval_s: float = 30.0
    cooldown_s: float = 60.0
    down_after: int = 2  # intervals in a row asking for fewer workers before a scale-down
    apply: bool = True  # False: advise only (logged, and the planner's gauges), change nothing
    # size for the machine the profile was taken on (its workers share its cores), not a device a worker
    as_profiled: bool = False

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.down_after < 1:
            raise ValueError(f"--autoscale-interval must be > 0, --autoscale-cooldown >= 0 and "
                             f"--autoscale-down-after >= 1; got {self.interval_s}, {self.cooldown_s}, "
                             f"{self.down_after}")


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
    kv_cache_memory_bytes: int | None = None  # or each worker's KV cache in bytes (vLLM's flag of that name)
    block_size: int | None = None  # tokens per KV block; None -> the engine's default (`kv_block_size`)
    # what runs the model in every pool ("builtin" or "vllm"), or per pool (None: `engine`)
    engine: str = "builtin"
    prefill_engine: str | None = None
    decode_engine: str | None = None
    # ranks each worker's model is split over (vLLM's tensor parallelism), in every pool or per pool (None:
    # `tensor_parallel_size`); the pools may differ: KV moves between them whole, every head
    tensor_parallel_size: int = 1
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # decode/colocated step budget
    prefill_max_num_batched_tokens: int = 2048  # prefill pool step budget (fair order: the chunk cap below)
    prefill_order: str = "fair"  # prompts by fewest uncomputed tokens, aged ("fifo": by arrival)
    prefill_chunk_tokens: int = 256  # fair order: the most prompt tokens a step computes, all prompts (0: budget)
    # the same on decode workers (local prefills): small, so a prompt computed there stalls its streams by
    # about one decode step at a time, not by the whole prompt at once (Sarathi-Serve's stall-free batching)
    decode_prefill_chunk_tokens: int = 64
    # fair order: the lower priority classes' prompt tokens per step while a higher class is recent (0: no cap)
    lower_class_chunk_tokens: int = 128
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
    kv_cache_dtype: str | None = None  # the built-in engine's KV cache dtype; None: the model's (CacheConfig.dtype)
    # "gguf" / "none": a GGUF model's blocks kept or dequantised (EngineConfig.quantization)
    quantization: str | None = None
    speculative: str | None = None  # decode and colocated workers: None (off) or "ngram"
    num_speculative_tokens: int = 8  # the most drafts verified per sequence per step
    max_draft_tokens_per_step: int = 32  # the most drafts one step verifies, shared by its sequences (0: no cap)
    tls_cert: str | None = None  # PEM: serve gRPC over TLS with this certificate chain ...
    tls_key: str | None = None  # ... and private key
    tls_client_ca: str | None = None  # mutual TLS: clients must present a certificate this CA signed
    api_key: str | None = field(default=None, repr=False)  # every call but health needs "Bearer <key>"
    # a key file naming tenants, their keys, roles and limits (router.tenants); reloaded when it changes
    api_keys: str | None = None
    # a stream whose client takes no token for this long is cancelled and its blocks freed (router.stall_watch)
    stalled_stream_timeout: float = 30.0
    http_header_timeout: float = 10.0  # an HTTP request's head must arrive within this (slowloris)
    http_max_connections_per_client: int = 256  # open HTTP connections one client address may hold (0: any)
    routers: int = 1  # router replicas sharing --port (and --http-port) over the same pools
    routers_spread: bool = False  # place the other replicas over the nodes, not on this one
    max_pool_size: int = 64  # the most workers `pdserve scale` may ask of one pool
    autoscale: AutoscaleConfig | None = None  # the planner's watch in this process (control.autoscale)

    def __post_init__(self) -> None:
        for name in ("engine", "prefill_engine", "decode_engine"):
            value = getattr(self, name)
            if value is not None and value not in BACKENDS:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(BACKENDS)}, got {value!r}")
        if self.pool_engine(PoolKind.PREFILL) != self.pool_engine(PoolKind.DECODE) and not self.colocated_workers:
            # NOTE: KV moves between the pools block for block; the engines' blocks differ in size (16 and 128
            # tokens by default) and in layout (vLLM's CPU cache interleaves heads and K/V its own way)
            raise ValueError(f"--prefill-engine {self.pool_engine(PoolKind.PREFILL)} and --decode-engine "
                             f"{self.pool_engine(PoolKind.DECODE)}: their KV layouts differ (block_size and the "
                             "per-block layout), so KV cannot move between the pools; run both on one engine")
        self._check_tensor_parallel()
        if self.speculative is not None and self.pool_engine(PoolKind.DECODE) == "vllm":
            raise ValueError("--speculative is the built-in engine's; it cannot be combined with --engine vllm")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_dtype is not None and "vllm" in self.engines():
            raise ValueError("--kv-cache-dtype is the built-in engine's; a vLLM engine keeps its KV in the model's "
                             "dtype (use --dtype)")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization == "gguf" and "vllm" in self.engines():
            raise ValueError("--quantization gguf is the built-in engine's; a vLLM engine loads the model's "
                             "HF directory (use --engine builtin, or drop --quantization)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory-bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_memory_bytes is not None and self.num_blocks is not None:
            raise ValueError("--num-blocks and --kv-cache-memory-bytes both size each worker's KV cache: "
                             "pass one")
        for name in ("prefill_workers", "decode_workers", "colocated_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.colocated_workers and (self.prefill_workers or self.decode_workers):
            raise ValueError("--colocated-workers cannot be mixed with --prefill-workers/--decode-workers; "
                             "pass --prefill-workers 0 --decode-workers 0")
        if not self.colocated_workers and not (self.prefill_workers and self.decode_workers):
            raise ValueError("need at least one prefill and one decode worker (or --colocated-workers N)")
        if self.autoscale is not None:
            if self.colocated_workers:
                raise ValueError("--autoscale sizes the prefill and decode pools; it cannot size colocated workers")
            if self.metrics_port is None:
                raise ValueError("--autoscale reads the router's own metrics: it needs --metrics-port (not off)")
            if self.kv_cache_memory_bytes is not None:
                # NOTE: the simulation counts decode room in blocks (`control.autoscale.as_deployed`)
                raise ValueError("--autoscale counts each worker's KV room in blocks: size the cache with "
                                 "--num-blocks, not --kv-cache-memory-bytes")
            if self.autoscale.as_profiled:
                from planner.sizing import check_as_profiled

                check_as_profiled(self.max_pool_size)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: pass both, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")
        if not self.stalled_stream_timeout > 0:
            raise ValueError(f"--stalled-stream-timeout must be > 0 seconds, got {self.stalled_stream_timeout}")
        if not self.http_header_timeout > 0:
            raise ValueError(f"--http-header-timeout must be > 0 seconds, got {self.http_header_timeout}")
        if self.http_max_connections_per_client < 0:
            raise ValueError("--http-max-connections-per-client must be >= 0 (0: no cap), got "
                             f"{self.http_max_connections_per_client}")
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
        if self.lower_class_chunk_tokens < 0:
            raise ValueError("--lower-class-chunk-tokens must be >= 0 (0: no cap of their own), got "
                             f"{self.lower_class_chunk_tokens}")
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

    def _check_tensor_parallel(self) -> None:
        """Each pool's ranks: vLLM's only, and with as many GPUs as ranks where the pool asks for GPUs."""
        flags = {PoolKind.PREFILL: ("prefill_resources", "--prefill-resources"),
                 PoolKind.DECODE: ("decode_resources", "--decode-resources"),
                 PoolKind.COLOCATED: ("decode_resources", "--decode-resources")}
        for kind in self.pool_kinds():
            field_name, resources_flag = flags[kind]
            tp, flag = self.pool_tensor_parallel_size(kind), self.tensor_parallel_flag(kind)
            if tp < 1:
                raise ValueError(f"{flag} must be >= 1, got {tp}")
            if tp > 1 and self.pool_engine(kind) != "vllm":
                raise ValueError(f"{flag} {tp}: the built-in engine runs one device per worker; tensor "
                                 "parallelism needs --engine vllm")
            gpus = getattr(self, field_name).get("GPU")
            if tp > 1 and gpus is not None and gpus < tp:  # (one rank may take a share of a GPU)
                raise ValueError(f"{resources_flag} gives each worker {gpus:g} GPU for {tp} tensor-parallel "
                                 f"ranks: ask for {tp}")

    def pool_kinds(self) -> list[PoolKind]:
        return [PoolKind.COLOCATED] if self.colocated_workers else [PoolKind.PREFILL, PoolKind.DECODE]

    def _own_tensor_parallel_size(self, kind: PoolKind) -> int | None:
        return {PoolKind.PREFILL: self.prefill_tensor_parallel_size,
                PoolKind.DECODE: self.decode_tensor_parallel_size}.get(kind)

    def tensor_parallel_flag(self, kind: PoolKind) -> str:
        """The flag that set a pool's tensor-parallel size (for errors)."""
        own = self._own_tensor_parallel_size(kind)
        if own is None or own == self.tensor_parallel_size:
            return "--tensor-parallel-size"
        return f"--{kind.value}-tensor-parallel-size"

    def pool_tensor_parallel_size(self, kind: PoolKind) -> int:
        """The ranks each of a pool's workers splits its model over."""
        own = self._own_tensor_parallel_size(kind)
        return self.tensor_parallel_size if own is None else own

    @property
    def needs_rendezvous(self) -> bool:
        """Whether the workers' KV links meet at a rendezvous store (torch.distributed between pools)."""
        return not self.colocated_workers and self.kv_transport == "torch"

    def pool_engine(self, kind: PoolKind) -> str:
        """The engine a pool's workers run."""
        own = {PoolKind.PREFILL: self.prefill_engine, PoolKind.DECODE: self.decode_engine}.get(kind)
        return own or self.engine

    def engines(self) -> set[str]:
        """The engines this deployment's pools run (colocated, or prefill and decode)."""
        return {self.pool_engine(k) for k in self.pool_kinds()}

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: --block-size, or the engine's own default (every pool runs one engine's)."""
        kind = PoolKind.COLOCATED if self.colocated_workers else PoolKind.DECODE
        return self.block_size or DEFAULT_BLOCK_SIZE[self.pool_engine(kind)]

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers + self.colocated_workers

    @property
    def num_ranks(self) -> int:
        """The model replicas' ranks over every pool: the processes that compute."""
        sizes = {PoolKind.PREFILL: self.prefill_workers, PoolKind.DECODE: self.decode_workers,
                 PoolKind.COLOCATED: self.colocated_workers}
        return sum(sizes[k] * self.pool_tensor_parallel_size(k) for k in self.pool_kinds())

    def engine_config(self, budget: int, decodes: bool = True, chunk: int | None = None,
                      kind: PoolKind = PoolKind.DECODE) -> EngineConfig:
        """A pool's workers' engine; `decodes`: it runs decode steps (so speculation applies to it); `chunk`:
        its prompt tokens per step (default --prefill-chunk-tokens)."""
        # (per rank: a worker over ranks runs one process of its own for each)
        threads = self.worker_threads or max(1, (os.cpu_count() or 1) // self.num_ranks)
        spec = (SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.max_draft_tokens_per_step)
                if decodes else SpeculativeConfig())
        return EngineConfig(model=self.model, device=self.device, dtype=self.dtype,
                            max_model_len=self.max_model_len, num_threads=threads,
                            cache=CacheConfig(block_size=self.kv_block_size, num_blocks=self.num_blocks,
                                              memory_bytes=self.kv_cache_memory_bytes,
                                              dtype=self.kv_cache_dtype),
                            scheduler=SchedulerConfig(self.max_num_seqs, budget, prefill_order=self.prefill_order,
                                                      prefill_chunk_tokens=self.prefill_chunk_tokens
                                                      if chunk is None else chunk,
                                                      lower_class_chunk_tokens=self.lower_class_chunk_tokens),
                            speculative=spec, backend=self.pool_engine(kind),
                            quantization=None if self.pool_engine(kind) == "vllm" else self.quantization,
                            tensor_parallel_size=self.pool_tensor_parallel_size(kind))

    def tls(self) -> TLSConfig | None:
        """The TLS files, checked to exist (ValueError naming the flag): at start, not at parse time, so a
        deploy file's command parses anywhere."""
        if self.tls_cert is None:
            return None
        return TLSConfig(Path(self.tls_cert), Path(self.tls_key),
                         Path(self.tls_client_ca) if self.tls_client_ca else None)

    def key_table(self) -> KeyTable | None:
        """The keys the doors accept: --api-keys (checked here, at start: ValueError names the file) plus
        --api-key as the `default` tenant's admin key; None when neither is set (no key required)."""
        if self.api_keys is None:
            return KeyTable.single(self.api_key) if self.api_key else None
        table = KeyTable.from_file(self.api_keys)
        if self.api_key:
            table.add(self.api_key, ANONYMOUS)
        return table

    def router_config(self, router_id: RouterId = None) -> RouterConfig:
        return RouterConfig(self.kv_block_size, self.routing, self.max_queue, self.admission_timeout_s,
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
                             self.engine_config(self.max_num_batched_tokens, kind=PoolKind.COLOCATED),
                             self.decode_resources)]
        return [PoolSpec(PoolKind.PREFILL, self.prefill_workers,
                         self.engine_config(self.prefill_max_num_batched_tokens, decodes=False, kind=PoolKind.PREFILL),
                         self.prefill_resources),
                PoolSpec(PoolKind.DECODE, self.decode_workers,
                         self.engine_config(self.max_num_batched_tokens, chunk=self.decode_prefill_chunk_tokens),
                         self.decode_resources)]


def kv_transfer_config(config: ServeConfig, store: tuple[str, int] | None) -> KVTransferConfig | None:
    """The workers' KV transfer: None for colocated pools, the Ray object store, or torch.distributed links
    meeting at the rendezvous `store` (host, port; needed when `config.needs_rendezvous`)."""
    if config.colocated_workers:
        return None
    if not config.needs_rendezvous:
        return KVTransferConfig(kv_transport=config.kv_transport)
    host, port = store
    # NOTE: a fresh secret per deployment, handed to the workers inside this config (through Ray, over the
    # cluster network the threat model trusts): every link request in the store must carry its MAC
    return KVTransferConfig(kv_transport="torch", rendezvous_host=host, rendezvous_port=port,
                            secret=secrets.token_hex(32))
