"""The accuracy table's corrections for a shared machine: the speed indexes (memory bandwidth, matrix
multiplies) the profile and each bench run record, and the decode and prefill constants scaled by them."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from benchmarks import planner_accuracy
from benchmarks.serving import cpu
from tests.planner.test_simulator import profile


def test_the_meter_probes_the_machine_at_both_ends_of_each_span_and_reports_the_means(monkeypatch):
    monkeypatch.setattr(cpu, "PROBE_S", 0.02)
    memory, compute = cpu.machine_speed()
    assert 0.1 < memory < 1000 and 0.1 < compute < 10_000  # GB/s, GFLOP/s of one core: any machine here
    spans = [cpu.CpuMeter(probe=True).stop() for _ in range(2)]
    assert all(s is not None and len(s.speeds) == 2 for s in spans)
    both = spans[0] + spans[1]
    assert len(both.speeds) == 4
    d = both.to_dict()
    assert d["memory_gbps"] == pytest.approx(sum(m for m, _ in both.speeds) / 4, abs=0.01)
    assert d["compute_gflops"] == pytest.approx(sum(c for _, c in both.speeds) / 4, abs=0.1)
    unprobed = cpu.CpuMeter().stop()
    assert unprobed is not None and "memory_gbps" not in unprobed.to_dict()


MEASURED = {"ttft": {"p50": 0.1, "p90": 0.2}, "itl": {"p50": 0.05}}
CASE = {"workload": "chat", "rate": 0.05, "num_requests": 4, "seed": 0, "layout": "1p1d",
        "others_cores": None, "memory_gbps": 5.0, "compute_gflops": None, "measured": MEASURED}


def test_a_run_at_half_the_profile_s_memory_speed_is_simulated_with_decode_steps_twice_as_long():
    p = profile()
    probed = dataclasses.replace(p, samples={"memory_gbps": [9.0, 11.0], "compute_gflops": [100.0, 100.0]})
    row = planner_accuracy.evaluate(probed, CASE)
    as_profiled, paced = row["simulated"], row["simulated_at_machine_speed"]
    # requests 20 s apart decode alone: ITL is the decode step, doubled; the prefill is not scaled (the run
    # has no compute index)
    assert paced["itl_s"]["p50"] == pytest.approx(2 * as_profiled["itl_s"]["p50"], rel=0.02)
    assert paced["ttft_s"]["p50"] == pytest.approx(as_profiled["ttft_s"]["p50"], rel=0.02)
    # and at a third more compute, the prefill takes 3/4 as long: TTFT less the router's 10 ms
    faster = planner_accuracy.evaluate(probed, CASE | {"memory_gbps": None, "compute_gflops": 133.3333})
    router = p.router.request_s
    assert faster["simulated_at_machine_speed"]["ttft_s"]["p50"] - router == pytest.approx(
        0.75 * (as_profiled["ttft_s"]["p50"] - router), rel=0.02)
    # a profile or a run without the indexes: that table is left out
    assert "simulated_at_machine_speed" not in planner_accuracy.evaluate(p, CASE)
    assert "simulated_at_machine_speed" not in planner_accuracy.evaluate(probed, CASE | {"memory_gbps": None})


def test_a_failed_probe_costs_the_run_its_speed_index_not_the_run(monkeypatch):
    monkeypatch.setattr(cpu, "PROBE_S", 0.02)

    def broken(seconds=None):
        raise subprocess.CalledProcessError(1, "python", stderr="no numpy")

    monkeypatch.setattr(cpu, "compute_gflops", broken)
    assert cpu.machine_speed() is None
    share = cpu.CpuMeter(probe=True).stop()
    assert share is not None and share.speeds == () and "memory_gbps" not in share.to_dict()
