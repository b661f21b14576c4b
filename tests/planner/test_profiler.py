"""`pdserve plan profile`'s sweeps against a real 1P+1D deployment (tiny-random, loopback, the session's Ray
cluster), with every sweep shortened: each one runs through the real router and workers, and the fit takes
what they measured. (The full sweeps take minutes on SmolLM2; `benchmarks/results/planner/accuracy_runs.sh`
runs them.)"""

from __future__ import annotations

import asyncio

import pytest

from planner import profiler
from planner.profile import EngineSettings
from tests.serving.conftest import running_server

pytestmark = pytest.mark.slow


def test_every_sweep_runs_against_a_deployment_and_the_fit_takes_them(ray_cluster, monkeypatch):
    # tiny-random holds 1,024 positions: every sweep scaled down to fit, and to take seconds
    for name, value in (("PREFILL_LENGTHS", (32, 64, 128)), ("CACHED_CASES", ((128, 32),)),
                        ("DECODE_BATCHES", ((1, 16), (2, 16), (4, 16), (2, 160))), ("LONG_PROMPT", 128),
                        ("INTERFERENCE_PROMPT", 320), ("SHORT_INTERFERENCE_PROMPT", 48),
                        ("DECODE_OUTPUT", 8), ("REPEATS", 1)):
        monkeypatch.setattr(profiler, name, value)
    # NOTE: the machine-speed probe (2 s of copying and a torch subprocess, twice) is not what this test is
    # about; the profile records its index, here a fixed one
    monkeypatch.setattr("benchmarks.serving.cpu.machine_speed", lambda: (10.0, 100.0))
    with running_server(model="tiny-random", prefill_workers=1, decode_workers=1) as server:
        assert server.server.router is not None
        profile = asyncio.run(profiler.profile_server(server.address, EngineSettings(), None, 2,
                                                      server.server.router.cost))
    samples = profile.samples
    assert [s["prompt_len"] for s in samples["prefill"]] == [32, 64, 128]
    assert samples["cached"][0]["cached"] > 0  # the repeated prefix hit the prefix cache
    assert [(d["batch"], d["prompt_len"]) for d in samples["decode"]] == [(1, 16), (2, 16), (4, 16), (2, 160)]
    assert samples["decode"][-1]["cached_first"]
    for key, prompt_len in (("interference", 320), ("short_interference", 48)):
        assert samples[key]["prompt_len"] == prompt_len and samples[key]["prefill_s"], key
        assert samples[key]["batch"] == profiler.INTERFERENCE_BATCH and samples[key]["gap_p50_s"] > 0
    assert samples["memory_gbps"] == [10.0, 10.0] and samples["compute_gflops"] == [100.0, 100.0]
    # the fit follows what was measured: prefill times within half of their fitted line, the step at batch 1
    # within 2x of the gaps measured there, the stretches in the range the fit caps them to
    checks = samples["checks"]
    assert checks["prefill_fit_error_median"] < 0.5, checks
    batch1 = samples["decode"][0]["gap_p50_s"]
    assert batch1 / 2 < profile.decode.step(1, 1 * (16 + profiler.DECODE_OUTPUT / 2)) < batch1 * 2
    assert 0 <= profile.interference <= 1
    assert profile.short_interference is not None and profile.short_interference[0] == 48
    assert 0 <= profile.short_interference[1] <= 1
