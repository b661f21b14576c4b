"""The draft-length bench on tiny-random: every policy reproduces the plain engine's greedy tokens (the run
asserts it) and reports a ratio per workload and batch; a bad policy name is refused by name."""

from __future__ import annotations

import json

import pytest

from benchmarks import spec_draft_bench


def test_quick_run_reports_every_policy_for_every_workload(tmp_path, capsys):
    out = tmp_path / "r.json"
    spec_draft_bench.main(["--quick", "--json", "--out", str(out), "--policies", "k4,k8-cap32"])
    summary = json.loads(out.read_text())
    assert summary["policies"] == {"k4": [4, 0], "k8-cap32": [8, 32]}
    assert set(summary["results"]) == {"repetition_b1", "repetition_b2", "chat_b1", "chat_b2"}
    for row in summary["results"].values():
        assert row["plain_tok_s"] > 0 and row["k4"] > 0 and row["k8-cap32"] > 0
    assert json.loads(capsys.readouterr().out) == summary
    assert "k8-cap32" in spec_draft_bench.table(summary)


def test_an_unknown_policy_is_named():
    with pytest.raises(SystemExit, match="medusa"):
        spec_draft_bench.main(["--quick", "--policies", "k4,medusa"])
