"""Percentiles, per-request ITL bookkeeping, SLO attainment, throughput and the goodput search, against
hand-computed cases."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from benchmarks.serving.client import RequestRecord, RunResult
from benchmarks.serving.goodput import GoodputSearch, Probe
from benchmarks.serving.load import Load
from benchmarks.serving.stats import SLO, Percentiles, attainment, percentile, summarize


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # position 1.5 of [1, 2, 3, 4]
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # position 2.7
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)  # position 2.97
    assert Percentiles.of([10, 20, 30, 40, 50]) == pytest.approx((30, 46, 49.6))
    assert percentile([7], 99) == 7 and percentile([1, 9], 0) == 1 and percentile([1, 9], 100) == 9
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_percentile_matches_numpy_default():
    rng = random.Random(0)
    for n in (2, 3, 10, 101, 997):
        xs = [rng.expovariate(1) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def record(i: int, sent: float, messages: list[tuple[float, int]], *, prompt: int = 16, cached: int = 0,
           error: str | None = None) -> RequestRecord:
    r = RequestRecord(i, "x", prompt, sum(n for _, n in messages), sent_at=sent, cached_prompt_tokens=cached)
    for t, n in messages:
        r.on_message(t, n)
    if error is None:
        r.done_at = messages[-1][0]
    r.error = error
    return r


def test_record_splits_a_multi_token_message_into_equal_gaps():
    r = record(0, 1.0, [(1.5, 3), (1.7, 2), (1.7, 0), (2.0, 1)])
    assert r.ttft == 0.5 and r.e2e == 1.0 and r.num_output_tokens == 6
    assert r.itls == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.3])
    assert r.mean_itl == pytest.approx(0.5 / 5)
    single = record(1, 0.0, [(0.2, 1)])
    assert single.itls == [] and single.mean_itl is None


def test_summary_of_a_hand_made_run():
    recs = [
        record(0, 0.0, [(0.5, 1), (0.6, 1), (0.8, 1)], prompt=32, cached=16),  # ttft 0.5, gaps 0.1 0.2
        record(1, 1.0, [(1.2, 1)]),  # one token: no gaps
        record(2, 1.0, [(3.0, 1)], error="UNAVAILABLE: gone"),  # failed: counted as sent, never met
        record(3, 2.0, [(4.0, 1), (4.05, 1), (4.1, 1)], prompt=48),  # ttft 2.0: misses the TTFT SLO
    ]
    slo = SLO(ttft_s=1.0, itl_s=0.16)
    assert [slo.met_by(r) for r in recs] == [True, True, False, False]
    assert not SLO(1.0, 0.14).met_by(recs[0])  # its mean gap is 0.15
    assert attainment(recs, slo) == 0.5 and attainment([], slo) == 0.0

    s = summarize(RunResult(Load(rate=1), recs, duration_s=4.1), slo)
    assert (s.num_sent, s.num_completed, s.num_failed) == (4, 3, 1)
    assert s.num_output_tokens == 8  # the failed request's token counts as received
    assert s.output_tokens_per_s == pytest.approx(8 / 4.1) and s.requests_per_s == pytest.approx(3 / 4.1)
    assert s.ttft == pytest.approx((0.5, 1.7, 1.97))  # of [0.2, 0.5, 2.0]
    assert s.itl.p50 == pytest.approx(0.075)  # of [0.05, 0.05, 0.1, 0.2]
    assert s.e2e.p50 == pytest.approx(0.8)  # of [0.2, 0.8, 2.1]
    assert s.cached_share == pytest.approx(16 / 96)
    assert s.slo_attainment == 0.5
    assert s.to_dict()["ttft"]["p50"] == pytest.approx(0.5)
    # every request's TTFT and mean ITL, in sending order, so another SLO's attainment reads back from JSON
    per_request = json.loads(json.dumps(s.to_dict()))["per_request"]
    assert per_request == [[0.5, pytest.approx(0.15)], [pytest.approx(0.2), None], [None, None],
                           [2.0, pytest.approx(0.05)]]
    assert sum(t is not None and t <= 1.0 and (i is None or i <= 0.14) for t, i in per_request) == 1


def step(threshold: float):
    return lambda rate: 1.0 if rate <= threshold else 0.5


def run_search(search: GoodputSearch, attainment_at) -> list[float]:
    probes: list[Probe] = []
    while (rate := search.next_rate(probes)) is not None:
        probes.append(Probe(rate, attainment_at(rate)))
    return probes


def test_goodput_search_doubles_then_bisects_to_the_tolerance():
    search = GoodputSearch(start_rate=1.0, max_probes=8, tolerance=0.1)
    probes = run_search(search, step(2.7))
    # 1 pass, 2 pass, 4 fail, bisect: 3 fail, 2.5 pass, 2.75 fail -> bracket [2.5, 2.75] is within 10%
    assert [p.rate for p in probes] == [1, 2, 4, 3, 2.5, 2.75]
    g = search.result(probes)
    assert (g.rate, g.upper) == (2.5, 2.75)


def test_goodput_search_halves_while_failing_and_stops_at_the_probe_budget():
    search = GoodputSearch(start_rate=1.0, max_probes=5)
    probes = run_search(search, step(0.3))
    assert [p.rate for p in probes] == [1, 0.5, 0.25, 0.375, 0.3125]
    assert (search.result(probes).rate, search.result(probes).upper) == (0.25, 0.3125)


def test_goodput_search_edges():
    search = GoodputSearch(start_rate=1.0, max_probes=3)
    g = search.result(run_search(search, lambda r: 1.0))  # never fails: a lower bound only
    assert (g.rate, g.upper) == (4, None)
    g = search.result(run_search(search, lambda r: 0.0))  # nothing passes
    assert (g.rate, g.upper) == (0.0, 0.25)
    # exactly the target passes; a noisy pass above a failure wins, and the search goes on above it
    search = GoodputSearch(start_rate=1.0, max_probes=9, target=0.9)
    probes = [Probe(1, 0.9), Probe(2, 0.89), Probe(4, 0.95)]
    assert search.result(probes).rate == 4 and search.next_rate(probes) == 8
    for bad in (dict(start_rate=0), dict(start_rate=1, max_probes=0), dict(start_rate=1, target=1.5),
                dict(start_rate=1, factor=1), dict(start_rate=1, tolerance=0)):
        with pytest.raises(ValueError):
            GoodputSearch(**bad)


def test_a_miss_is_certain_once_the_first_token_is_late_or_the_request_ended_without_meeting():
    slo = SLO(ttft_s=1.0, itl_s=0.1)
    waiting = RequestRecord(0, "x", 16, 4, sent_at=10.0)
    assert not slo.missed(waiting, now=10.9) and slo.missed(waiting, now=11.1)
    assert not slo.missed(RequestRecord(1, "x", 16, 4), now=99.0)  # created, not sent yet
    early = record(2, 10.0, [(10.5, 1)])
    early.done_at = None  # still streaming, first token in time: its ITL is not known yet
    assert not slo.missed(early, now=50.0)
    assert slo.missed(record(3, 10.0, [(11.5, 1)]), now=12.0)  # first token late
    assert slo.missed(record(4, 10.0, [(10.2, 1), (10.6, 1)]), now=11.0)  # ended, mean gap 0.4
    assert slo.missed(record(5, 10.0, [(10.2, 1)], error="ABORTED: x"), now=11.0)


def test_a_probe_is_hopeless_once_more_than_the_allowed_share_missed():
    rule = GoodputSearch(start_rate=1.0, target=0.9).hopeless(SLO(1.0, 0.1))
    ok = [record(i, 0.0, [(0.5, 1)]) for i in range(5)]
    late = [record(10 + i, 0.0, [(2.0, 1)]) for i in range(3)]
    # 30 planned: 10% allows 3 misses, the 4th makes the probe fail whatever the others do
    assert not rule(ok + late, 30, 5.0)
    assert rule(ok + late + [record(20, 0.0, [(3.0, 1)])], 30, 5.0)
    assert rule(ok + late, 20, 5.0)  # 20 planned: 2 misses allowed


def test_summary_json_has_no_nan():
    import json

    s = summarize(RunResult(Load(rate=1), [record(0, 0.0, [(1.0, 1)], error="UNAVAILABLE: x")], duration_s=1.0),
                  SLO(1.0, 0.1))
    assert math.isnan(s.ttft.p50)
    d = s.to_dict()
    assert d["ttft"]["p50"] is None and d["stages_p50"]["queue"] is None
    json.dumps(d, allow_nan=False)


def test_the_summary_counts_where_completed_prompts_were_prefilled():
    records = [record(i, 0.0, [(1.0, 1)], cached=cached) for i, cached in enumerate([0, 32, 32, 0])]
    for r, where in zip(records, ["remote", "local", "local", "local"]):
        r.placement = where
    records.append(record(9, 0.0, [(1.0, 1)], error="UNAVAILABLE: x"))  # failed: not counted
    records[-1].placement = "remote"
    s = summarize(RunResult(Load(rate=1), records, duration_s=1.0), SLO(1.0, 0.1))
    assert s.placements == {"remote": 1, "local": 3} and s.cache_hit_placements == {"local": 2}
    assert s.to_dict()["cache_hit_placements"] == {"local": 2}
