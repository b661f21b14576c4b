"""The simulator on cases checked by hand: one request alone, a burst queueing on one prefill worker, a
colocated step stalling its streams, a slow link, a full decode pool, a shared prefix, shared cores."""

from __future__ import annotations

import dataclasses
import math

import pytest

from planner.profile import DecodeCost, EngineSettings, PrefillCost, Profile, RouterCost, TransferCost
from planner.results import SLO
from planner.simulator import SimOptions, simulate
from planner.trace import Trace, TraceRequest

PREFILL = PrefillCost(step_s=0.02, token_s=0.001, attention_s=0.0)
DECODE = DecodeCost(step_s=0.02, seq_s=0.005, context_token_s=0.0)
TRANSFER = TransferCost(bytes_per_token=1000, bytes_per_s=1e9, latency_s=0.0)
ROUTER = RouterCost(request_s=0.01, token_s=0.0)


def profile(**changes) -> Profile:
    base = Profile("test", {}, "2026-12-03T00:00:00Z", PREFILL, DECODE, TRANSFER, ROUTER, EngineSettings())
    return dataclasses.replace(base, **changes)


def trace(*requests: tuple[float, int, int]) -> Trace:
    return Trace(tuple(TraceRequest(t, p, o) for t, p, o in requests), "test")


def test_one_request_alone_is_its_prefill_steps_plus_the_router_then_decode_steps_at_batch_1():
    result = simulate(profile(), "1p1d", trace((0.0, 512, 5)))
    (r,) = result.requests
    # two 256-token steps: 2 x (0.02 + 0.256); the router adds 0.01
    assert r.ttft_s == pytest.approx(2 * (0.02 + 0.256) + 0.01)
    # each later token is one decode step at batch 1: 0.02 + 0.005 (the KV push of 0.5 MB takes 0.5 ms)
    assert r.mean_itl_s == pytest.approx(0.025, abs=0.001)
    assert result.itl.p50 == pytest.approx(0.025)
    assert result.num_completed == 1
    assert result.utilisation["decode-0"] < result.utilisation["prefill-0"]


def test_a_burst_queues_on_one_prefill_worker_and_spreads_over_two():
    burst = trace(*[(0.0, 256, 2)] * 3)
    one = sorted(r.ttft_s for r in simulate(profile(), "1p1d", burst).requests)
    step = 0.02 + 0.256
    assert one == pytest.approx([step + 0.01, 2 * step + 0.01, 3 * step + 0.01])
    two = sorted(r.ttft_s for r in simulate(profile(), "2p1d", burst).requests)
    assert two == pytest.approx([step + 0.01, step + 0.01, 2 * step + 0.01])


def test_a_colocated_prompt_stalls_the_streams_decoding_beside_it_and_a_decode_worker_does_not():
    streams_then_prompt = trace((0.0, 32, 40), (0.3, 256, 2))
    colocated = simulate(profile(), "1c", streams_then_prompt)
    disaggregated = simulate(profile(), "1p1d", streams_then_prompt)
    # the stream's worst gap: a decode step carrying the 256-token chunk (0.02 + 0.005 + 0.256)
    assert max(g for g, _ in colocated.itl_gaps) == pytest.approx(0.281)
    # no stall there: the longest gap is the newcomer's first, the step in progress when its KV landed plus
    # one at batch 2 (at most 0.025 + 0.03)
    assert max(g for g, _ in disaggregated.itl_gaps) <= 0.055 + 1e-9


def test_a_reservation_made_at_placement_waits_for_the_decode_workers_step_in_progress():
    alone = simulate(profile(), "1p1d", trace((0.3, 256, 2)))
    beside = simulate(profile(), "1p1d", trace((0.0, 32, 40), (0.3, 256, 2)))
    # the stream's KV lands at 0.052 (and 32 us on the link) and it decodes in steps of 0.025: the one in
    # progress at 0.3 ends at 0.302, and only then does the prompt reach the prefill worker
    assert alone.requests[0].ttft_s == pytest.approx(0.276 + 0.01)
    assert beside.requests[1].ttft_s == pytest.approx(0.002 + 0.276 + 0.01, abs=1e-4)


def test_a_slow_link_delays_the_second_token_not_the_first():
    fast = simulate(profile(), "1p1d", trace((0.0, 512, 3)))
    slow = simulate(profile(transfer=TransferCost(1000, 1e6)), "1p1d", trace((0.0, 512, 3)))
    assert slow.requests[0].ttft_s == pytest.approx(fast.requests[0].ttft_s)
    # the last chunk's 256 tokens x 1000 bytes at 1 MB/s land 0.256 s after the first token
    first_gap = max(g for g, _ in slow.itl_gaps)
    assert first_gap == pytest.approx(0.256 + 0.025, abs=0.002)


def test_a_full_decode_pool_queues_the_next_request_until_blocks_free():
    small = profile(engine=EngineSettings(num_blocks=20))  # 256 + 40 tokens: 19 blocks, one request at a time
    result = simulate(small, "1p1d", trace((0.0, 256, 40), (0.0, 256, 40)))
    first, second = sorted(result.requests, key=lambda r: r.ttft_s)
    assert second.ttft_s > first.e2e_s  # it was placed only once the first one finished
    roomy = simulate(profile(), "1p1d", trace((0.0, 256, 40), (0.0, 256, 40)))
    assert max(r.ttft_s for r in roomy.requests) < first.e2e_s


def test_a_shared_prefix_is_placed_on_the_worker_that_caches_it_and_costs_only_its_tail():
    reqs = tuple(TraceRequest(t, 1024 + 32, 2, "session", 1024) for t in (0.0, 10.0))
    result = simulate(profile(), "2p1d", Trace(reqs, "agent"))
    cold, warm = (r.ttft_s for r in result.requests)
    assert cold == pytest.approx(5 * 0.02 + 1.056 + 0.01)
    assert warm == pytest.approx(0.02 + 0.032 + 0.01)  # the 32-token tail only, on the caching worker
    # one of the two prefill workers did both
    busy = sorted(result.utilisation[w] for w in ("prefill-0", "prefill-1"))
    assert busy[0] == 0.0


def test_workers_sharing_fewer_cores_than_they_are_slow_each_other_down():
    two_at_once = trace((0.0, 256, 2), (0.0, 256, 2))
    own = simulate(profile(), "2c", two_at_once)
    shared = simulate(profile(shared_cores=1), "2c", two_at_once)
    assert max(r.ttft_s for r in own.requests) == pytest.approx(0.276 + 0.01)
    assert max(r.ttft_s for r in shared.requests) > 0.276 * 1.5


def test_more_decode_workers_cut_itl_under_a_decode_heavy_load_and_attainment_follows():
    heavy = trace(*[(i * 0.05, 64, 200) for i in range(60)])
    one, two = simulate(profile(), "1p1d", heavy), simulate(profile(), "1p2d", heavy)
    assert two.itl.p50 < one.itl.p50
    slo = SLO(ttft_s=5.0, itl_s=0.15)
    assert two.attainment(slo) >= one.attainment(slo)


def test_stop_after_leaves_unfinished_requests_as_misses():
    heavy = trace(*[(0.0, 1000, 100)] * 10)
    result = simulate(profile(), "1p1d", heavy, SimOptions(stop_after_s=1.0))
    assert result.num_completed < 10
    assert result.attainment(SLO(100.0, 100.0)) < 1.0


def test_interference_stretches_a_step_for_each_worker_computing_beside_it():
    two_at_once = trace((0.0, 256, 2), (0.0, 256, 2))
    result = simulate(profile(shared_cores=2, interference=0.5), "2c", two_at_once)
    # the second step starts while the first computes: 1.5x; the first started alone
    assert sorted(r.ttft_s for r in result.requests) == pytest.approx([0.276 + 0.01, 0.276 * 1.5 + 0.01])


def test_a_short_prompt_loses_more_to_a_neighbour_than_a_long_one(tmp_path):
    """A short prefill reads the weights as a decode step does, so a decoding neighbour slows it more than a
    long, compute-bound one (`short_interference`, interpolated on log(tokens) up to the long measurement)."""
    p = profile(shared_cores=2, interference=0.5, short_interference=(64, 1.0))
    assert p.interference_at(32) == p.interference_at(64) == 1.0
    assert p.interference_at(1280) == p.interference_at(4096) == 0.5
    mid = 1.0 + math.log(256 / 64) / math.log(1280 / 64) * (0.5 - 1.0)
    assert p.interference_at(256) == pytest.approx(mid)
    # measured at one length only: that figure at every length
    assert profile(interference=0.5).interference_at(32) == 0.5
    # the second prompt's step starts while the first computes: its step overhead by the long figure (a
    # decode step's), its 256 prompt tokens by the interpolated one
    result = simulate(p, "2c", trace((0.0, 256, 2), (0.0, 256, 2)))
    assert sorted(r.ttft_s for r in result.requests) == pytest.approx(
        [0.276 + 0.01, 0.02 * 1.5 + 0.256 * (1 + mid) + 0.01])
    # stored as JSON (a list) and read back as it was
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").short_interference == (64, 1.0)
    with pytest.raises(ValueError, match="short_interference"):
        profile(short_interference=(0, 1.0))


def test_more_workers_than_cores_wait_for_a_core_or_for_bandwidth_whichever_is_more():
    three_at_once = trace(*[(0.0, 256, 2)] * 3)
    result = simulate(profile(shared_cores=2, interference=0.1), "3c", three_at_once)
    # alone: 1x; beside one other: the interference, 1.1x; beside two: 3 workers on 2 cores, 1.5x (> 1.2x)
    assert sorted(r.ttft_s for r in result.requests) == pytest.approx(
        [0.276 + 0.01, 0.276 * 1.1 + 0.01, 0.276 * 1.5 + 0.01])
