"""The router benchmark runs and accounts for every token it relays (fake workers, real gRPC, real router)."""

from __future__ import annotations

import pytest

from benchmarks.router_bench import run

pytestmark = pytest.mark.slow


def test_router_bench_relays_every_token_and_measures_the_router_process():
    r = run(concurrency=4, tokens=20, step_s=0.005, duration_s=2.0)
    assert r["requests"] >= 4
    # every request completed: 20 tokens each (the first counts as TTFT, the rest as gaps)
    assert r["relayed_tokens"] == r["requests"] * 20
    assert 0 < r["router_cpu_ms_per_token"] < 50 and r["tokens_per_s"] > 0
    assert r["itl_ms"]["p50"] >= 5.0 * 0.9  # no faster than the fake decode step


# (soak: the default suite serves through two router replicas on one port in
# tests/serving/test_router_replicas.py; this is the bench's own two-process mode)
@pytest.mark.soak
def test_two_router_processes_share_the_port_and_relay_every_token():
    r = run(concurrency=8, tokens=20, step_s=0.005, duration_s=2.0, routers=2)
    assert r["routers"] == 2 and r["requests"] >= 8
    assert r["relayed_tokens"] == r["requests"] * 20
    assert 0 < r["router_cpu_ms_per_token"] < 50
