"""`pdserve serve --autoscale`: the planner's watch loop run by the serve process over its own pools.

The default suite runs it advising only, beside the dashboard's Prometheus (tests/observability: the
planner's panels have data). `pytest -m soak tests/serving/test_autoscale.py` runs it applying its plans
on a real deployment (tiny-random, Ray actors): a closed-loop load past what the pool cap can take grows
both pools to the cap, and idleness shrinks them back by draining, with no failed request.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from control.config import AutoscaleConfig
from protocol import PoolKind
from tests.serving.conftest import greedy_request, running_server, token_ids

pytestmark = pytest.mark.slow

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/results/planner/profile-smollm2-cpu.json"


def _metric(server, name: str, **labels) -> float:
    return sum(s.value for fam in server.server.metrics.registry.collect() for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _targets(server) -> dict[str, int]:
    return {k.value: server.server.pools.targets[k] for k in (PoolKind.PREFILL, PoolKind.DECODE)}


def _wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


@pytest.mark.soak
def test_autoscale_grows_the_pools_under_load_and_drains_them_back_when_idle(ray_cluster, tmp_path):
    slo = tmp_path / "slo.json"
    slo.write_text(json.dumps({"ttft_s": 0.5, "itl_s": 0.05, "target": 0.9}))
    autoscale = AutoscaleConfig(str(slo), str(PROFILE), interval_s=2.0, cooldown_s=4.0, down_after=2)
    with running_server(model="tiny-random", num_blocks=256, max_pool_size=2, autoscale=autoscale) as server:
        errors: list[str] = []
        done = [0]
        stop = threading.Event()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                prompt = [rng.randrange(256) for _ in range(rng.randrange(300, 500))]
                try:
                    if len(token_ids(server.generate(greedy_request(prompt, 24, ignore_eos=True), timeout=60))) == 24:
                        done[0] += 1
                except grpc.RpcError as e:
                    errors.append(f"{e.code().name}: {e.details()}")

        load = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in load:
            t.start()
        try:  # the smollm2 CPU profile cannot take this load with 2 workers a pool: the most capacity, 2p2d
            _wait("both pools at the cap", lambda: _targets(server) == {"prefill": 2, "decode": 2}, 60)
            _wait("the new workers serving", lambda: len(server.server.registry.schedulable(PoolKind.PREFILL)) == 2
                  and len(server.server.registry.schedulable(PoolKind.DECODE)) == 2, 120)
            served_at_cap = done[0]
            _wait("the grown deployment to serve on", lambda: done[0] > served_at_cap, 30)
        finally:
            stop.set()
            for t in load:
                t.join(60)
        _wait("both pools back to one worker", lambda: _targets(server) == {"prefill": 1, "decode": 1}
              and len(server.server.registry.live(PoolKind.DECODE)) == 1
              and len(server.server.registry.live(PoolKind.PREFILL)) == 1, 90)
        assert not errors, errors[:3]
        for pool in ("prefill", "decode"):
            assert _metric(server, "pdserve_planner_decisions_total", pool=pool, direction="up") >= 1
            assert _metric(server, "pdserve_planner_decisions_total", pool=pool, direction="down") >= 1
        assert _metric(server, "pdserve_workers_lost_total") == 0  # retired by drains, not lost
        assert _metric(server, "pdserve_planner_planned_workers", pool="decode") == 1
