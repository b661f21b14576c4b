"""Server layouts started by the bench itself (`--launch`), in this process, on one local Ray cluster.

A layout is a short spec: `1p1d` (1 prefill + 1 decode worker), `2p1d:round-robin` (with the router's
round-robin policy instead of the default prefix-aware one), `2c` (2 colocated workers, each prefilling and
decoding its own requests).

NOTE: why in-process and not `pdserve serve` subprocesses. One Ray cluster (started once, pinned to
loopback by `init_ray`) serves every layout, so the runs differ only in the layout, and `ray.init`'s few
seconds are paid once. The workers are Ray actor processes either way; only the routers share this
process (and its GIL) with the load generator, the same way for every layout. On a 2-core machine that is
also the cheaper choice: a router subprocess per layout would be more processes competing with the
workers. Each layout's `Server` runs on its own event-loop thread. All layouts stay up for the whole bench
(`compare` explains why); only one is ever offered load, the others' workers sit idle.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass
from typing import Any

_SPEC = re.compile(r"^(?:(?P<p>\d+)p(?P<d>\d+)d|(?P<c>\d+)c)(?::(?P<routing>prefix|round-robin|separate|local))?"
                   r"(?::(?P<order>fair|fifo))?(?::chunk(?P<chunk>\d+))?(?::dchunk(?P<dchunk>\d+))?"
                   r"(?P<early>:early)?(?::kv-(?P<kv>float32|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2))?"
                   r"(?::(?P<quant>gguf|dense))?(?P<vllm>:vllm)?$")


@dataclass(frozen=True)
class Layout:
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated_workers: int = 0
    # the router's prefill placement policy ("prefix", "round-robin"), or: "separate" (prefix, then the decode
    # worker by node and free blocks: the baseline of joint placement, the default), "local" (joint placement
    # with local prefill on decode workers: conditional disaggregation)
    routing: str = "prefix"
    prefill_order: str = "fair"  # the workers' prompt order ("fifo": arrival, the earlier default)
    prefill_chunk_tokens: int | None = None  # the prefill workers' prompt tokens per step (None: the default)
    decode_prefill_chunk_tokens: int | None = None  # the decode workers' (None: the default)
    late_reservation: bool = True  # ":early": every prompt's decode blocks are reserved at placement
    engine: str = "builtin"  # ":vllm": every worker runs an in-process vLLM engine
    kv_cache_dtype: str | None = None  # ":kv-fp8" etc.: the workers' KV cache dtype (None: the model's)
    # ":gguf" / ":dense": the built-in engine keeps a GGUF model's blocks or dequantises them (--quantization
    # gguf / none; None: the engine's default for the model)
    quantization: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Layout:
        m = _SPEC.match(spec.strip().lower())
        if m is None:
            raise ValueError(f"layout {spec!r}: expected NpMd (N prefill + M decode workers) or Nc (N colocated "
                             "workers), optionally followed by :prefix, :round-robin, :separate or :local, "
                             "then optionally :fifo or :fair (the prompt order), then optionally :chunkN and "
                             ":dchunkN (the prefill and decode workers' prompt tokens per step), then optionally "
                             ":early (decode blocks reserved at placement), then optionally :kv-DTYPE "
                             "(the KV cache's dtype: float32, bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2), "
                             "then optionally :gguf or :dense (a GGUF model's weights kept in their "
                             "blocks or dequantised), then optionally :vllm (vLLM engines), e.g. "
                             "2p1d:round-robin, 2p1d:fifo, 2p1d:chunk256, 2p1d:local:dchunk0, 2p1d:early, "
                             "1c:kv-fp8, 1c:gguf, 1p1d:vllm")
        routing, order = m["routing"] or "prefix", m["order"] or "fair"
        chunk, dchunk = (int(m[k]) if m[k] is not None else None for k in ("chunk", "dchunk"))
        engine = "vllm" if m["vllm"] else "builtin"
        if m["kv"] and m["vllm"]:
            raise ValueError(f"layout {spec!r}: :kv-{m['kv']} is the built-in engine's KV cache dtype; "
                             "a vLLM engine keeps its KV in the model's dtype (drop :kv- or :vllm)")
        if m["quant"] and m["vllm"]:
            raise ValueError(f"layout {spec!r}: :{m['quant']} is the built-in engine's; a vLLM engine "
                             f"loads the model's HF directory (drop :{m['quant']} or :vllm)")
        quantization = {"gguf": "gguf", "dense": "none", None: None}[m["quant"]]
        shape = (0, 0, int(m["c"])) if m["c"] is not None else (int(m["p"]), int(m["d"]), 0)
        return cls(*shape, routing, order, chunk, dchunk, m["early"] is None, engine, m["kv"], quantization)

    @property
    def num_workers(self) -> int:
        return self.prefill_workers + self.decode_workers + self.colocated_workers

    @property
    def label(self) -> str:
        shape = (f"{self.colocated_workers}c" if self.colocated_workers
                 else f"{self.prefill_workers}p{self.decode_workers}d")
        label = shape if self.routing == "prefix" else f"{shape}:{self.routing}"
        label = label if self.prefill_order == "fair" else f"{label}:{self.prefill_order}"
        label = label if self.prefill_chunk_tokens is None else f"{label}:chunk{self.prefill_chunk_tokens}"
        label = label if self.decode_prefill_chunk_tokens is None else f"{label}:dchunk{self.decode_prefill_chunk_tokens}"
        label = label if self.late_reservation else f"{label}:early"
        label = label if self.kv_cache_dtype is None else f"{label}:kv-{self.kv_cache_dtype}"
        if self.quantization is not None:
            label = f"{label}:{'gguf' if self.quantization == 'gguf' else 'dense'}"
        return label if self.engine == "builtin" else f"{label}:{self.engine}"

    @property
    def description(self) -> str:
        if self.colocated_workers:
            what = f"{self.colocated_workers} colocated worker{'s' if self.colocated_workers > 1 else ''}"
        else:
            what = f"{self.prefill_workers} prefill + {self.decode_workers} decode workers"
        order = "" if self.prefill_order == "fair" else ", prompts in arrival order"
        for who, n in (("prefill", self.prefill_chunk_tokens), ("decode", self.decode_prefill_chunk_tokens)):
            if n is not None:
                order += f", {who} workers' prompt tokens per step: {n or 'the whole budget'}"
        if not self.late_reservation:
            order += ", decode blocks reserved at placement"
        if self.kv_cache_dtype is not None:
            order += f", KV cache in {self.kv_cache_dtype}"
        if self.quantization is not None:
            order += ", weights in GGUF blocks" if self.quantization == "gguf" else ", weights dequantised"
        if self.engine != "builtin":
            order += f", {self.engine} engines"
        if self.routing == "separate":
            return f"{what}, prefix routing, then the decode worker by node and free blocks{order}"
        if self.routing == "local":
            return f"{what}, joint placement with local prefill{order}"
        return (f"{what}, {self.routing} routing" + ("" if self.colocated_workers else ", joint placement")
                + order)

    def serve_config(self, **options: Any):
        """The `ServeConfig` of this layout; `options` are its other fields (model, worker_threads, ...)."""
        from control.config import ServeConfig

        routing = "prefix" if self.routing in ("separate", "local") else self.routing
        for key in ("prefill_chunk_tokens", "decode_prefill_chunk_tokens", "kv_cache_dtype", "quantization"):
            if getattr(self, key) is not None:
                options = {**options, key: getattr(self, key)}
        return ServeConfig(prefill_workers=self.prefill_workers, decode_workers=self.decode_workers,
                           colocated_workers=self.colocated_workers, routing=routing,
                           placement="separate" if self.routing == "separate" else "joint",
                           local_prefill=self.routing == "local", prefill_order=self.prefill_order,
                           late_reservation=self.late_reservation, engine=self.engine, **options)


class LocalDeployment:
    """A `control.server.Server` on its own event-loop thread; a context manager that stops it on exit."""

    def __init__(self, config: Any) -> None:
        from control.server import Server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-server", daemon=True)
        self.server = Server(config)
        self.address = ""

    def __enter__(self) -> LocalDeployment:
        self.thread.start()
        try:
            self._run(self.server.start(), timeout=600)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.address = f"{self.server.config.host}:{self.server.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            try:
                self._run(self.server.stop(), timeout=60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def start_ray(layouts: list[Layout]) -> None:
    """One local Ray cluster on 127.0.0.1 with a CPU slot for every worker of every layout (all are up at
    once; Ray's CPU count is a slot count here, not the machine's cores).

    NOTE: Ray starts worker processes at nice 15 (its `worker_niceness`), so on a shared machine any
    nice-0 process (another user's test run, a compiler) takes the CPU from the workers almost entirely
    and the numbers measure the neighbours. `pin_ray_to_loopback` runs them at nice 0, like the router and
    the load generator. (A cluster already running in this process keeps its setting.)
    """
    from control.ray_cluster import init_ray, pin_ray_to_loopback

    pin_ray_to_loopback()  # before `import ray`
    import ray

    if ray.is_initialized():
        return
    init_ray(None, sum(layout.num_workers for layout in layouts))
