"""Traces match what `pdserve bench` sends; profiles round-trip; percentiles match the bench's rule."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.serving.load import poisson_offsets
from benchmarks.serving.workloads import make_workload
from planner.devices import on_device
from planner.profile import Profile
from planner.results import weighted_percentile
from planner.trace import TRACE_VOCAB, PrefixHashes, from_jsonl, from_workload, load_trace
from tests.planner.test_simulator import profile


def test_a_workload_trace_is_the_bench_s_requests_at_the_bench_s_arrival_times():
    trace = from_workload("burst", 2.0, 20, seed=3)
    specs = make_workload("burst").requests(20, 3, TRACE_VOCAB)
    assert [(r.prompt_len, r.output_len) for r in trace.requests] == [(s.num_prompt_tokens, s.max_tokens)
                                                                      for s in specs]
    assert [r.arrival_s for r in trace.requests] == poisson_offsets(20, 2.0, 3)


def test_agent_turns_share_their_session_s_prefix_blocks():
    trace = from_workload("agent", 1.0, 10)
    hashes = PrefixHashes(16)
    first, sixth, second = trace.requests[0], trace.requests[5], trace.requests[1]
    assert hashes.of(first) == hashes.of(sixth) and len(hashes.of(first)) == 64
    assert hashes.of(first)[0] != hashes.of(second)[0]


def test_a_jsonl_trace_loads_in_arrival_order_and_rescales_to_a_rate(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in [
        {"arrival_s": 2.0, "prompt_len": 10, "output_len": 3},
        {"arrival_s": 0.0, "prompt_len": 100, "output_len": 5, "prefix_id": "a", "prefix_len": 64}]))
    trace = from_jsonl(path)
    assert [r.prompt_len for r in trace.requests] == [100, 10]
    assert load_trace(str(path), 2.0, 0).requests[-1].arrival_s == pytest.approx(0.5)
    path.write_text('{"arrival_s": 0, "prompt_len": 0, "output_len": 1}')
    with pytest.raises(ValueError, match="prompt_len"):
        from_jsonl(path)


def test_a_profile_round_trips_and_refuses_another_version(tmp_path):
    p = profile(samples={"prefill": [[256, 0.3]]})
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    d = p.to_dict() | {"version": 99}
    with pytest.raises(ValueError, match="version"):
        Profile.from_dict(d)


def test_a_device_profile_takes_its_constants_from_published_figures_and_its_structure_from_the_measured_one():
    p = profile(shared_cores=2)
    h100 = on_device(p, "h100", "llama3-8b")
    assert h100.prefill.token_s == pytest.approx(2 * 8.03e9 / (989e12 * 0.5))
    assert h100.decode.step_s == pytest.approx(16.06e9 / (3.35e12 * 0.6))
    assert h100.transfer.bytes_per_token == 131_072 and h100.shared_cores is None
    assert h100.engine.prefill_chunk_tokens == 2048 and h100.router == p.router
    assert "published figures" in h100.source
    with pytest.raises(ValueError, match="--device"):
        on_device(p, "tpu-v9")


def test_the_weighted_percentile_is_the_bench_s_percentile_of_the_expanded_list():
    from benchmarks.serving.stats import percentile

    rng = random.Random(0)
    for _ in range(50):
        pairs = [(rng.random(), rng.randint(1, 5)) for _ in range(rng.randint(1, 12))]
        flat = [v for v, n in pairs for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert weighted_percentile(pairs, q) == pytest.approx(percentile(flat, q))
