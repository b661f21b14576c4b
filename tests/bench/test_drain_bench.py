"""The drain benchmark runs end to end (tiny model): every method moves the stream the way it says, and the
summary has a pause per method and context."""

from __future__ import annotations

import json

import pytest

from benchmarks.drain_bench import METHODS, main

pytestmark = pytest.mark.slow


def test_drain_bench_measures_each_method(ray_cluster, tmp_path):
    out = tmp_path / "drain.json"
    # NOTE: the bench itself asserts each drain moved the stream by the method asked for, and that the
    # stream got every token
    # NOTE: one ABC pass, not the default ABC CBA: half the worker restarts, and each method still measured
    assert main(["--model", "tiny-random", "--contexts", "64", "--max-tokens", "200", "--move-after", "8",
                 "--order", *METHODS, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert [r["method"] for r in summary["trials"]] == list(METHODS)
    ctx = summary["contexts"]["64"]
    assert all(ctx[f"pause_{m}_s"] > 0 for m in METHODS)
    assert all(r["drain_at_token"] >= 8 for r in summary["trials"])  # the move came after the tokens asked for
