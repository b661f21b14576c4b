"""The slow-link bench's summary: per placement, medians over every run of it, the slow link's share, and
the ratio the README quotes."""

from __future__ import annotations

import pytest

from benchmarks.slow_link_bench import _summary, _table


def run(placement: str, seconds: list[float], slow: list[bool]) -> dict:
    return {"placement": placement, "requests": [
        {"ttft_s": 0.5, "second_token_s": s, "decode": "decode-0", "slow_link": x} for s, x in zip(seconds, slow)]}


def test_the_summary_pools_abba_runs_per_placement_and_compares_them():
    slow = [True, False] * 3  # warm-up (WARMUP = 4), then the steady part
    runs = [run("separate", [4.0, 1.0] * 3, slow), run("joint", [4.0, 1.0, 1.0, 1.0, 1.0, 1.0], [True] + [False] * 5),
            run("joint", [1.0] * 6, [False] * 6), run("separate", [4.0, 1.0] * 3, slow)]
    s = _summary(runs)
    assert s["separate"]["requests"] == 12 and s["separate"]["slow_link_share"] == 0.5
    assert s["separate"]["slow_link_share_steady"] == 0.5 and s["joint"]["slow_link_share_steady"] == 0.0
    assert s["joint"]["slow_link_share"] == pytest.approx(1 / 12)
    assert s["separate"]["kv_wait_steady_mean_s"] == pytest.approx(2.0) and s["joint"]["kv_wait_steady_mean_s"] == 0.5
    assert s["joint_vs_separate_kv_wait_steady"] == pytest.approx(4.0)
    assert s["separate"]["second_token_steady_p50_s"] == 2.5 and s["joint"]["second_token_steady_p50_s"] == 1.0
    text = _table({"rate": "50mbit", "prompt_tokens": 512, "summary": s})
    assert "| separate |" in text and "| joint |" in text and "4.0x shorter" in text
