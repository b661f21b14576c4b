"""`pdserve plan size` picks the fewest workers that meet the SLO, its cheaper neighbours miss, the P:D
ratio follows the workload; the CLI's tables; the profile's fit recovers known constants."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.serving.launch import Layout
from control.cli import main as pdserve
from planner.profile import EngineSettings, Profile
from planner.profiler import DECODE_OUTPUT, fit_profile, prefill_features
from planner.results import SLO
from planner.sizing import SizingPlan, size
from planner.trace import Trace, TraceRequest
from tests.planner.test_simulator import profile


def shaped(prompt: int, output: int, rate: float, n: int = 80) -> Trace:
    return Trace(tuple(TraceRequest(i / rate, prompt, output) for i in range(n)), f"{prompt}x{output}")


def test_the_pick_meets_the_slo_and_its_cheaper_neighbours_do_not():
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    plan = size(profile(), shaped(512, 64, rate=6.0), slo, max_pool_size=16, colocated=False)
    assert plan.best is not None and plan.best.meets(slo)
    p, d = plan.best.layout.prefill_workers, plan.best.layout.decode_workers
    done = {c.layout.label: c for c in plan.searched}
    for cheaper in (f"{p - 1}p{d}d", f"{p}p{d - 1}d"):
        if cheaper in done:
            assert not done[cheaper].meets(slo), cheaper
    assert all(not c.meets(slo) for c in plan.searched if c.workers < plan.best.workers)


def test_past_every_pool_cap_the_closest_layout_is_the_largest_and_under_it_the_pick_is_the_closest():
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    capped = size(profile(), shaped(512, 64, rate=6.0), slo, max_pool_size=2, colocated=False)
    assert capped.best is None and capped.closest is not None  # nothing within 2 a pool meets it ...
    assert not capped.closest.meets(slo)
    assert capped.closest.layout.label == "2p2d"  # ... and the most capacity comes closest
    roomy = size(profile(), shaped(512, 64, rate=6.0), slo, max_pool_size=16, colocated=False)
    assert roomy.closest is roomy.best is not None


def test_past_every_cap_a_layout_within_five_points_of_the_closest_with_fewer_workers_is_taken():
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    some = size(profile(), shaped(512, 64, rate=6.0), slo, max_pool_size=2, colocated=False).searched[0]
    at = lambda label, a: dataclasses.replace(some, layout=Layout.parse(label), attainment=a)
    assert SizingPlan(None, [at("1p2d", 0.77), at("2p2d", 0.82)]).closest.layout.label == "1p2d"
    assert SizingPlan(None, [at("1p2d", 0.70), at("2p2d", 0.82)]).closest.layout.label == "2p2d"


def test_long_prompts_need_more_prefill_workers_and_long_outputs_more_decode_workers():
    slo = SLO(ttft_s=1.5, itl_s=0.05)
    prompts = size(profile(), shaped(1024, 16, rate=4.0), slo, max_pool_size=16, colocated=False).best
    outputs = size(profile(), shaped(64, 400, rate=4.0), slo, max_pool_size=16, colocated=False).best
    assert prompts is not None and outputs is not None
    ratio = lambda c: c.layout.prefill_workers / c.layout.decode_workers
    assert ratio(prompts) > 1 > ratio(outputs)


def test_as_profiled_two_shared_cores_meet_less_than_a_device_a_worker_and_every_layout_is_searched():
    slo = SLO(ttft_s=1.0, itl_s=0.05)
    shared = profile(shared_cores=2, interference=0.2)
    fleet = size(shared, shaped(512, 64, rate=2.0), slo, max_pool_size=4)
    assert fleet.best is not None  # a device a worker: three workers meet it ...
    here = size(shared, shaped(512, 64, rate=2.0), slo, max_pool_size=4, as_profiled=True)
    done = {c.layout.label: c for c in here.searched}
    assert here.best is None and done[fleet.best.layout.label].attainment < slo.target  # ... not on two cores
    assert len(done) == 4 * 4 + 8  # every (P, D) up to the cap, and colocated up to twice it
    light = size(shared, shaped(512, 64, rate=1.0), slo, max_pool_size=4, as_profiled=True)
    assert light.best is not None and all(not c.meets(slo) for c in light.searched if c.workers < light.best.workers)
    with pytest.raises(ValueError, match="--max-pool-size must be at most 6, got 16"):
        size(shared, shaped(512, 64, rate=1.0), slo, max_pool_size=16, as_profiled=True)


def test_the_plan_and_simulate_commands_print_their_tables_and_write_json(tmp_path, capsys):
    path = tmp_path / "p.json"
    profile().save(path)
    out = tmp_path / "plan.json"
    code = pdserve(["plan", "size", "--profile", str(path), "--workload", "chat", "--rate", "2",
                    "--num-requests", "40", "--ttft-slo", "1", "--itl-slo", "0.1", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "the pick" in text and "layouts simulated" in text
    best = json.loads(out.read_text())["best"]
    assert best in text
    code = pdserve(["plan", "simulate", "--profile", str(path), "--layout", "1p1d", "2c", "--workload", "burst",
                    "--rate", "1", "--num-requests", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines[1:]] == ["1p1d", "2c"]
    assert pdserve(["plan", "simulate", "--profile", str(tmp_path / "missing.json")]) == 2


def test_the_fit_recovers_the_constants_that_made_the_samples(tmp_path):
    truth, engine = profile(), EngineSettings()
    p, d = truth.prefill, truth.decode
    prefill = []
    for n in (32, 128, 256, 512, 1024, 1280):
        steps, tokens, pairs = prefill_features(n, 0, engine.prefill_chunk_tokens)
        seconds = steps * p.step_s + tokens * p.token_s + pairs * 1e-7
        prefill.append({"prompt_len": n, "cached": 0, "ttft_s": seconds + 0.004, "server_queue_s": 0.0,
                        "server_prefill_s": seconds, "kv_transfer_s": 0.001})
    decode = [{"batch": b, "prompt_len": n, "gap_p50_s": d.step(b, int(b * (n + DECODE_OUTPUT / 2))),
               "cached_first": n >= 512} for b, n in ((1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (2, 768), (8, 768))]
    # an old profile's batch of eight long prompts prefilled in the batch: its gaps mostly smaller batches
    decode.append({"batch": 8, "prompt_len": 768, "gap_p50_s": d.step(3, 3 * 768)})
    # a 1,280-token prefill beside a batch decoding for 2 s of it, at a stretch of 0.25: 0.4 s longer
    gap = 2.0 / (DECODE_OUTPUT - 1)
    solo = sum(c * f for c, f in zip((p.step_s, p.token_s, 1e-7), prefill_features(1280, 0, 256)))
    interference = {"batch": 4, "gap_p50_s": gap, "prompt_len": 1280, "prefill_s": [solo + 2.0 * 0.25 / 1.25]}
    # 128-token prefills beside the same batch, wholly inside it, at a stretch of 0.6
    short_solo = sum(c * f for c, f in zip((p.step_s, p.token_s, 1e-7), prefill_features(128, 0, 256)))
    short = {"batch": 4, "gap_p50_s": gap, "prompt_len": 128, "prefill_s": [short_solo * 1.6] * 3}
    samples = {"prefill": prefill, "cached": [], "decode": decode, "interference": interference,
               "short_interference": short}
    fitted = fit_profile(samples, engine, 1000, "test", 0.0, None, 2)
    assert fitted.prefill.step_s == pytest.approx(p.step_s, rel=1e-6)
    assert fitted.prefill.token_s == pytest.approx(p.token_s, rel=1e-6)
    assert fitted.prefill.attention_s == pytest.approx(1e-7, rel=1e-6)
    assert dataclasses.astuple(fitted.decode) == pytest.approx(dataclasses.astuple(d), rel=1e-6)
    assert fitted.router.request_s == pytest.approx(0.004)
    assert fitted.interference == pytest.approx(0.25, rel=1e-6)
    assert fitted.short_interference == (128, pytest.approx(0.6, rel=1e-6))
    # `plan profile --refit` fits the stored samples again and keeps where and when they were taken
    old = dataclasses.replace(fitted, machine={"host": "elsewhere"}, date="2026-01-01T00:00:00Z",
                              interference=0.06)
    old.save(tmp_path / "old.json")
    assert pdserve(["plan", "profile", "--refit", str(tmp_path / "old.json"), "--out", str(tmp_path / "new.json")]) == 0
    new = Profile.load(tmp_path / "new.json")
    assert new.interference == pytest.approx(0.25, rel=1e-6) and new.prefill == fitted.prefill
    assert (new.machine, new.date) == (old.machine, old.date) and "fitted again" in new.source


def test_a_margin_sizes_against_tighter_bounds_and_buys_headroom(tmp_path, capsys):
    # a layout that just meets the bounds as given stops meeting them 15% tighter, so the pick grows
    trace, slo = shaped(512, 64, rate=6.0), SLO(ttft_s=1.0, itl_s=0.05)
    plain = size(profile(), trace, slo, max_pool_size=16, colocated=False)
    tight = slo.with_margin(0.15)
    assert (tight.ttft_s, tight.itl_s, tight.target) == pytest.approx((0.85, 0.0425, 0.9))
    padded = size(profile(), trace, tight, max_pool_size=16, colocated=False)
    assert plain.best is not None and padded.best is not None and padded.best.meets(tight)
    assert padded.best.layout.num_workers > plain.best.layout.num_workers
    with pytest.raises(ValueError, match="margin"):
        slo.with_margin(1.0)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile().to_dict()))
    assert pdserve(["plan", "size", "--profile", str(path), "--rate", "1", "--num-requests", "5",
                    "--slo-margin", "-0.1"]) == 2
    assert "margin must be in [0, 1)" in capsys.readouterr().err
