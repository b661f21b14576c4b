"""The tenant benchmark runs end to end (tiny model, small numbers): the flooding tenant, in a process of its
own, is refused at the door past its quota and served within it, nothing else fails, and behind a burst of
class-0 prompts the class-9 request is answered before the class-0 control sent with it."""

from __future__ import annotations

import json

import pytest

from benchmarks.tenant_bench import main

pytestmark = pytest.mark.slow


def test_tenant_bench_refuses_the_flood_and_serves_the_high_class_first(ray_cluster, tmp_path):
    out = tmp_path / "tenants.json"
    assert main(["--model", "tiny-random", "--prompt-tokens", "512", "--probes", "3", "--flood", "4",
                 "--burst", "16", "--rounds", "2", "--lower-class-chunk-tokens", "128", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    for overload in (run["overload"], run["overload_polite"]):
        assert overload["flood_refused"] > 0 and overload["flood_requests"] > overload["flood_refused"]
        assert overload["flood_other_errors"] == []
        assert overload["refusal_max_s"] < 10  # (refused at the door, never after a queue's wait)
    # the control waits for the burst's 16 prompts; the high class for the step in progress
    assert sum(run["burst_high_ttft_s"]) < sum(run["burst_low_ttft_s"]), run
