"""`pdserve serve --autoscale SLO-FILE --autoscale-profile PROFILE`: the planner's watch loop
(`planner.watch.watch`, the loop of `pdserve plan watch --apply`) run by the serve process over its own
pools. Every interval it reads the router's counters from its registry, forecasts the next interval's rate,
sizes the pools for the SLO from the profile, and scales through the lead's `PoolAdmin`: up at once, down
by draining the least loaded workers with their KV moved, within --max-pool-size and the cool-down. Its
gauges (the forecast, the planned sizes, the plan's TTFT p90 and ITL p50, its decisions) join the router's
on the metrics port.

NOTE: the loop is a thread of its own (it mostly sleeps, and waits on the event loop for each Admin call),
and the sizing, a simulation of every candidate layout, runs in a child process: in this process it would
hold the GIL for seconds and stall every stream's tokens. With `--routers N` the lead's serve process runs
it; a replica that takes the pools over after the lead dies does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import threading
from typing import Any

from control.admin import PoolAdmin
from control.config import AutoscaleConfig, ServeConfig
from planner.autoscaler import Decision, ScalePolicy, parse_counters
from planner.profile import Profile
from planner.sizing import SizingPlan, size
from planner.watch import WatchGauges, load_slo, watch
from protocol import Method, PoolKind

__all__ = ["Autoscale"]

logger = logging.getLogger("pdserve.planner")
SCALE_TIMEOUT_S = 300.0  # one scale, its drains included


class LocalPools:
    """The pools of this process's `PoolAdmin`, called from the watch's thread on the server's event loop."""

    def __init__(self, admin: PoolAdmin, loop: asyncio.AbstractEventLoop) -> None:
        self.admin = admin
        self.loop = loop

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def sizes(self) -> dict[str, int]:
        async def read() -> dict[str, int]:
            return {s.pool.value: s.target for s in self.admin.sizes()}

        return self._run(read(), 30.0)

    def scale(self, d: Decision) -> str:
        out = self._run(self.admin.scale(PoolKind(d.pool), d.target, Method.KV, SCALE_TIMEOUT_S), SCALE_TIMEOUT_S + 30)
        return f"started {out.started}, retired {out.retired} (drained, KV moved)"


def as_deployed(profile: Profile, serve: ServeConfig) -> Profile:
    """The profile with this deployment's engine settings, where they differ from the ones it was taken
    with: the simulation schedules steps, and counts KV room, by them (--num-blocks is the decode pool's
    capacity in streams; left to free memory, the profile's count stands)."""
    chunk = serve.prefill_chunk_tokens or serve.prefill_max_num_batched_tokens
    engine = dataclasses.replace(profile.engine, block_size=serve.kv_block_size, prefill_chunk_tokens=chunk,
                                 max_num_batched_tokens=serve.max_num_batched_tokens, max_num_seqs=serve.max_num_seqs,
                                 num_blocks=serve.num_blocks or profile.engine.num_blocks)
    return dataclasses.replace(profile, engine=engine)


class Autoscale:
    def __init__(self, config: AutoscaleConfig, registry: Any, serve: ServeConfig) -> None:
        """`registry`: the router's metrics (read for the traffic, and where the planner's gauges go). Reads
        the SLO file and the profile now (ValueError naming the file), so a bad one stops `pdserve serve`
        before any worker starts."""
        self.config = config
        self.slo = load_slo(config.slo_file)
        self.profile = as_deployed(Profile.load(config.profile), serve)
        self.policy = ScalePolicy(config.cooldown_s, config.down_after, 1, serve.max_pool_size)
        self.registry = registry
        self.gauges = WatchGauges(None, registry=registry)
        self._stop = threading.Event()
        self._sizer = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._thread: threading.Thread | None = None

    def _counters(self) -> dict[str, float]:
        from prometheus_client import generate_latest

        return parse_counters(generate_latest(self.registry).decode())

    def _size(self, *args: Any, **kwargs: Any) -> SizingPlan:
        return self._sizer.submit(size, *args, **kwargs).result()

    def start(self, admin: PoolAdmin, loop: asyncio.AbstractEventLoop) -> None:
        c = self.config
        pools = LocalPools(admin, loop)

        def run() -> None:
            try:
                watch(pools, self._counters, self.profile, self.slo, self.policy, c.interval_s, c.apply, self.gauges,
                      stop=self._stop, sizer=self._size, as_profiled=c.as_profiled)
            except Exception:  # never silently: the deployment serves on, unscaled
                if not self._stop.is_set():
                    logger.exception("the autoscaler stopped; the pools keep their sizes")

        self._thread = threading.Thread(target=run, name="pdserve-autoscale", daemon=True)
        self._thread.start()
        logger.info("autoscaling the pools every %.0f s: TTFT <= %.2f s and ITL <= %.3f s for %.0f%% of requests "
                    "(%s)", c.interval_s, self.slo.ttft_s, self.slo.itl_s, self.slo.target * 100,
                    "applying" if c.apply else "advising only")

    def stop(self) -> None:
        self._stop.set()
        self._sizer.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout=5)
