"""Workload generators and the arrival process: lengths, structure, and seeds that reproduce."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.serving.load import Load, poisson_offsets
from benchmarks.serving.workloads import Agent, Burst, Jsonl, Shaped, Vocab, chat, make_workload, rag

VOCAB = Vocab.for_model(49152)


@pytest.mark.parametrize("workload", [chat(), rag()], ids=lambda w: w.name)
def test_shaped_lengths_stay_in_their_ranges_and_ids_in_the_vocabulary(workload: Shaped):
    reqs = workload.requests(300, seed=1, vocab=VOCAB)
    assert len(reqs) == 300
    lo, hi = workload.prompt_len
    assert all(lo <= r.num_prompt_tokens <= hi for r in reqs)
    assert all(workload.output_len[0] <= r.max_tokens <= workload.output_len[1] for r in reqs)
    assert all(VOCAB.low <= t < VOCAB.high for r in reqs for t in r.prompt_token_ids)
    # uniform over the range: both ends are reached in 300 draws of ranges this wide... nearly
    lengths = [r.num_prompt_tokens for r in reqs]
    assert min(lengths) < lo + (hi - lo) * 0.1 and max(lengths) > hi - (hi - lo) * 0.1


@pytest.mark.parametrize("name", ["chat", "rag", "agent", "burst"])
def test_same_seed_same_requests_other_seed_other_requests_and_prefix_stable(name):
    w = make_workload(name)
    a, b = w.requests(20, 7, VOCAB), w.requests(20, 7, VOCAB)
    assert a == b
    assert w.requests(20, 8, VOCAB) != a
    assert w.requests(35, 7, VOCAB)[:20] == a  # more requests extend the list, never reshuffle it


def test_vocab_keeps_clear_of_low_special_ids_and_fits_tiny_vocabularies():
    assert Vocab.for_model(49152) == (100, 49152)
    assert Vocab.for_model(320) == (80, 320)
    assert Vocab.for_model(8) == (2, 8)
    with pytest.raises(ValueError):
        Vocab.for_model(1)


def test_burst_puts_a_long_prompt_every_nth_request():
    w = Burst(long_every=4, long_prompt_len=(900, 1000), long_output_len=(8, 8))  # the defaults but lengths
    reqs = w.requests(13, 0, VOCAB)
    kinds = [r.kind for r in reqs]
    assert [i for i, k in enumerate(kinds) if k == "long"] == [0, 4, 8, 12]
    assert all(k == "chat" for i, k in enumerate(kinds) if i % 4)
    assert all(900 <= r.num_prompt_tokens <= 1000 and r.max_tokens == 8 for r in reqs if r.kind == "long")
    assert all(r.num_prompt_tokens <= 192 for r in reqs if r.kind == "chat")
    assert w.max_total_len == 1008


def test_agent_resends_each_sessions_prefix_turn_major_with_fresh_tails():
    w = Agent(sessions=3, prefix_len=50, tail_len=(5, 9), output_len=(2, 4))
    reqs = w.requests(9, 0, VOCAB)
    assert [r.kind for r in reqs] == ["agent-0", "agent-1", "agent-2"] * 3
    for s in range(3):
        turns = reqs[s::3]
        prefix = turns[0].prompt_token_ids[:50]
        assert all(t.prompt_token_ids[:50] == prefix for t in turns)
        assert all(55 <= t.num_prompt_tokens <= 59 for t in turns)
        assert len({t.prompt_token_ids[50:] for t in turns}) == 3  # a new tail every turn
    assert len({r.prompt_token_ids[:50] for r in reqs}) == 3  # one prefix per session
    assert w.max_total_len == 50 + 9 + 4


def test_jsonl_follows_the_file_wraps_around_and_names_a_bad_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_len": 10, "output_len": 3}\n\n{"prompt_len": 20, "output_len": 5, "kind": "x"}\n')
    w = make_workload(str(path))
    assert isinstance(w, Jsonl) and w.name == "trace"
    reqs = w.requests(5, 0, VOCAB)
    assert [(r.num_prompt_tokens, r.max_tokens, r.kind) for r in reqs] == [
        (10, 3, "jsonl"), (20, 5, "x"), (10, 3, "jsonl"), (20, 5, "x"), (10, 3, "jsonl")]
    assert w.max_total_len == 25
    path.write_text('{"prompt_len": 10, "output_len": 3}\n{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="trace.jsonl:2"):
        make_workload(str(path))


def test_check_fits_names_the_workload_and_the_limit():
    rag().check_fits(2048)
    with pytest.raises(ValueError, match=r"'rag'.*1328.*1024"):
        rag().check_fits(1024)
    with pytest.raises(ValueError, match="workload must be one of"):
        make_workload("nope")


def test_poisson_arrivals_start_at_zero_scale_with_the_rate_and_reproduce():
    a = poisson_offsets(2000, rate=4.0, seed=3)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a == poisson_offsets(2000, rate=4.0, seed=3)
    assert a != poisson_offsets(2000, rate=4.0, seed=4)
    assert poisson_offsets(2000, rate=2.0, seed=3) == pytest.approx([2 * t for t in a])
    gaps = [y - x for x, y in zip(a, a[1:])]
    # exponential gaps: mean 1/rate, standard deviation 1/rate (std error of the mean ~2.2% here)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)


def test_open_loop_is_bounded_by_count_and_by_duration():
    assert len(Load(rate=10, num_requests=50).arrival_offsets()) == 50
    offsets = Load(rate=10, num_requests=1000, duration_s=5).arrival_offsets()
    assert 25 < len(offsets) < 80 and offsets[-1] <= 5
    assert Load(concurrency=3).label == "concurrency 3" and Load(rate=1.5).label == "1.5 req/s"
    for bad in (dict(), dict(rate=1, concurrency=2), dict(rate=0), dict(concurrency=0),
                dict(rate=1, num_requests=0), dict(rate=1, duration_s=0)):
        with pytest.raises(ValueError):
            Load(**bad)
