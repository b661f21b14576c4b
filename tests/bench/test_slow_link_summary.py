"""The slow-link bench's summary: per placement, medians over every run of it, the slow link's share, and
the ratio the README quotes."""

from __future__ import annotations

import pytest

from benchmarks.slow_link_bench import _summary, _table


def run(placement: str, seconds: list[float], slow: list[bool]) -> dict:
    return {"placement": placement, "requests": [
        {"ttft_s": 0.5, "second_token_s": s, "decode": "decode-0", "slow_link": x} for s, x in zip(seconds, slow)]}


def test_the_summary_pools_abba_runs_per_placement_and_compares_them():
    runs = [run("separate", [1.0, 4.0], [False, True]), run("joint", [1.0, 1.2], [False, False]),
            run("joint", [1.1, 4.2], [False, True]), run("separate", [4.1, 1.1], [True, False])]
    s = _summary(runs)
    assert s["separate"]["requests"] == 4 and s["separate"]["slow_link_share"] == 0.5
    assert s["joint"]["slow_link_share"] == 0.25
    assert s["separate"]["second_token_p50_s"] == pytest.approx((1.1 + 4.0) / 2)
    assert s["joint"]["second_token_p50_s"] == pytest.approx((1.1 + 1.2) / 2)
    assert s["joint_vs_separate_second_token_p50"] == pytest.approx(2.55 / 1.15)
    text = _table({"rate": "50mbit", "prompt_tokens": 512, "summary": s})
    assert "| separate |" in text and "| joint |" in text and "2.22x" in text
