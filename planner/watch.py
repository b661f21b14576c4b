"""`pdserve plan watch`: every interval, read the router's live traffic, forecast the next interval, size the
pools for the SLO from the profile, and say (advisory) or do (`--apply`) what should change.

    pdserve plan watch --server 127.0.0.1:50051 --metrics http://127.0.0.1:9400/metrics \
        --profile profile.json --slo-file slo.json [--apply] [--interval 30] [--cooldown 60]

The SLO file: {"ttft_s": 2.0, "itl_s": 0.1, "target": 0.9}. With `--apply` it scales through the Admin API
(`ScalePool`): up starts workers, down drains the least loaded with their KV moved (nothing is dropped).
A change the server refuses (another in progress, a pool at --max-pool-size) is logged and tried again at
the next interval. Its own gauges (`--port`): the forecast rate, each pool's planned size, the plan's
estimated TTFT p90 and ITL p50, and its decisions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from planner.autoscaler import (
    Autoscaler,
    Decision,
    Forecaster,
    RateWindow,
    ScalePolicy,
    Traffic,
    parse_counters,
    sizes_to_ask,
)
from planner.profile import Profile
from planner.results import SLO
from planner.sizing import Candidate, SizingPlan, size
from planner.trace import Trace, TraceRequest

logger = logging.getLogger("pdserve.planner")
LENGTH_SPREAD = 0.5  # the synthetic trace's lengths: uniform within +-50% of the measured means
MIN_TRACE_S, MAX_TRACE_REQUESTS = 60.0, 2000


def load_slo(path: str) -> SLO:
    try:
        d = json.loads(Path(path).read_text())
        slo = SLO(float(d["ttft_s"]), float(d["itl_s"]), float(d.get("target", 0.9)))
        return slo.with_margin(float(d.get("margin", 0.0)))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: expected {{\"ttft_s\": S, \"itl_s\": S[, \"target\": 0.9, \"margin\": 0]}}: "
                         f"{e}") from e


def synthetic_trace(traffic: Traffic, rate: float, seed: int = 0) -> Trace:
    """Poisson arrivals at `rate` of requests shaped like the interval's, enough for a minute."""
    import random

    from benchmarks.serving.load import poisson_offsets

    n = max(20, min(MAX_TRACE_REQUESTS, int(rate * MIN_TRACE_S)))
    rng = random.Random(seed)

    def length(mean: float) -> int:
        return max(1, round(mean * rng.uniform(1 - LENGTH_SPREAD, 1 + LENGTH_SPREAD)))

    return Trace(tuple(TraceRequest(t, length(traffic.mean_prompt), length(traffic.mean_output))
                       for t in poisson_offsets(n, rate, seed)), f"live@{rate:.2f}")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (an operator-given URL)
        return parse_counters(response.read().decode())


class WatchGauges:
    """The watcher's own metrics (dashboard panels read them): in `registry` (`pdserve serve --autoscale`: the
    router's, on its metrics port), else in their own, served on `port` when one is given."""

    def __init__(self, port: int | None, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.rate = Gauge("pdserve_planner_forecast_requests_per_second", "The next interval's forecast rate.",
                          registry=r)
        self.planned = Gauge("pdserve_planner_planned_workers", "Each pool's size in the latest plan.", ["pool"],
                             registry=r)
        self.ttft = Gauge("pdserve_planner_estimated_ttft_p90_seconds", "The plan's simulated TTFT p90.", registry=r)
        self.itl = Gauge("pdserve_planner_estimated_itl_p50_seconds", "The plan's simulated ITL p50.", registry=r)
        self.decisions = Counter("pdserve_planner_decisions", "Pool changes decided, by pool and direction.",
                                 ["pool", "direction"], registry=r)
        for pool in ("prefill", "decode"):  # every series from the start: rate() and increase() need two samples
            for direction in ("up", "down"):
                self.decisions.labels(pool, direction)
        if port is not None and registry is None:
            start_http_server(port, "127.0.0.1", registry=r)

    def record(self, rate: float, wanted: Mapping[str, int], pick: Candidate | None,
               decisions: list[Decision]) -> None:
        """`wanted`: each pool's planned size (the floor when idle); `pick`: the simulated layout behind it."""
        self.rate.set(rate)
        for pool, n in wanted.items():
            self.planned.labels(pool).set(n)
        if pick is not None:
            self.ttft.set(pick.result.ttft.p90)
            self.itl.set(pick.result.itl.p50)
        for d in decisions:
            self.decisions.labels(d.pool, "up" if d.target > d.current else "down").inc()


class Pools(Protocol):
    """The pools the watch sizes: over the Admin API (`PoolsClient`), or in the serve process itself
    (`control.autoscale`)."""

    def sizes(self) -> dict[str, int]: ...

    def scale(self, d: Decision) -> str: ...


class PoolsClient:
    """The Admin API: the pools' targets, and changing them."""

    def __init__(self, address: str, security) -> None:
        from protos.pdserve.v1 import admin_pb2_grpc

        self.channel = security.channel(address)
        self.stub = admin_pb2_grpc.AdminStub(self.channel)

    def sizes(self) -> dict[str, int]:
        from protos.pdserve.v1 import admin_pb2 as pb
        from protos.pdserve.v1 import generation_pb2 as gen_pb

        res = self.stub.ListWorkers(pb.ListWorkersRequest(), timeout=30)
        return {gen_pb.PoolKind.Name(p.pool).removeprefix("POOL_KIND_").lower(): p.target for p in res.pools}

    def scale(self, d: Decision, timeout_s: float = 300.0) -> str:
        from protos.pdserve.v1 import admin_pb2 as pb
        from protos.pdserve.v1 import generation_pb2 as gen_pb

        res = self.stub.ScalePool(pb.ScalePoolRequest(
            pool=gen_pb.PoolKind.Value(f"POOL_KIND_{d.pool.upper()}"), num_workers=d.target,
            method=pb.MigrationMethod.Value("MIGRATION_METHOD_KV"), timeout_seconds=timeout_s), timeout=timeout_s + 30)
        return f"started {list(res.started)}, retired {list(res.retired)} (drained, KV moved)"


def watch(pools: Pools, counters: Callable[[], Mapping[str, float]], profile: Profile, slo: SLO,
          policy: ScalePolicy, interval_s: float, apply: bool, gauges: WatchGauges, rounds: int | None = None,
          stop: threading.Event | None = None, sizer: Callable[..., SizingPlan] = size,
          as_profiled: bool = False) -> None:
    """The loop: `rounds` intervals (None: until interrupted, or until `stop` is set). `counters()`: the
    router's counters now (`scrape(url)` over HTTP); `sizer`: `size`, or the same run elsewhere (the serve
    process runs it in a child process, off the router's event loop); `as_profiled`: size for the profile's
    machine (`size(as_profiled=True)`)."""
    forecaster, scaler, window = Forecaster(), Autoscaler(policy), RateWindow()
    stop = stop or threading.Event()
    start = counters()
    window.add(time.monotonic(), start)
    k = 0
    while (rounds is None or k < rounds) and not stop.wait(interval_s):
        k += 1
        try:
            after, t_after = counters(), time.monotonic()
        except OSError as e:  # the router restarting, a node lost: keep watching
            logger.warning("interval %d: cannot read the router's metrics (%s); trying again next interval", k, e)
            continue
        # NOTE: the rate is the window's (`RateWindow`); the lengths are the means since the watch began:
        # prompt tokens are counted when a prefill ends and requests when a stream ends, so over one short
        # interval the two counts belong to different requests (3 prefills over 1 finished stream read as 3x
        # the prompt)
        shape = Traffic.between(start, after, 1.0)
        traffic = Traffic(window.add(t_after, after), shape.mean_prompt, shape.mean_output)
        rate = forecaster.observe(traffic.rate)
        plan, decisions = None, []
        try:
            current = pools.sizes()
        except Exception as e:  # grpc.RpcError: the Admin API is down for now
            logger.warning("interval %d: cannot read the pools (%s); trying again next interval", k, e)
            continue
        if traffic.rate > 0 and rate > 0:
            plan = sizer(profile, synthetic_trace(traffic, rate), slo, max_pool_size=policy.max_pool_size,
                         colocated=False, as_profiled=as_profiled)
        wanted: dict[str, int] = {}
        if rate == 0:  # no traffic: the smallest pools
            wanted = {"prefill": policy.min_pool_size, "decode": policy.min_pool_size}
            decisions = scaler.decide(time.monotonic(), current, wanted, "no requests lately, none forecast")
        pick = plan.closest if plan is not None else None
        if pick is not None:  # (a plan is made only for traffic)
            how = ("meets" if pick is plan.best else
                   f"comes closest within --max-pool-size {policy.max_pool_size} (no layout meets it): it meets")
            planned = {"prefill": pick.layout.prefill_workers, "decode": pick.layout.decode_workers}
            wanted = sizes_to_ask(planned, current, meets=pick is plan.best)
            held = "" if wanted == planned else "; no pool shrinks while none meets it"
            why = (f"{traffic.rate:.2f} req/s now, {rate:.2f} forecast, prompts {traffic.mean_prompt:.0f} / outputs "
                   f"{traffic.mean_output:.0f} tokens: {pick.layout.label} {how} the SLO for {pick.attainment:.0%} "
                   f"(TTFT p90 {pick.result.ttft.p90:.2f} s, ITL p50 {pick.result.itl.p50 * 1e3:.0f} ms)"
                   f"{held}")
            decisions = scaler.decide(time.monotonic(), current, wanted, why)
        logger.info("interval %d: %.2f req/s, forecast %.2f; plan %s", k, traffic.rate, rate,
                    pick.layout.label if pick is not None else "-")
        for d in decisions:
            if not apply:
                logger.info("advice: %s", d.reason)
                continue
            try:
                logger.info("scaling: %s -> %s", d.reason, pools.scale(d))
                # NOTE: the cool-down runs from when the change is done: a new worker can take a minute to
                # load, and its first interval should not already count towards the next change
                scaler.last_change[d.pool] = time.monotonic()
            except Exception as e:  # a refused change (another in progress, a bound) waits for the next interval
                logger.warning("scale of %s refused: %s; trying again next interval", d.pool, e)
                scaler.last_change.pop(d.pool, None)
        gauges.record(rate, wanted, pick, decisions)
