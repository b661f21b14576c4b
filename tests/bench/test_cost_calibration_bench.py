"""The cost-calibration bench on tiny-random: both rules report a ratio to the truth for both measurements,
and the compute-share rule is the closer one for a prefill worker that shares its steps."""

from __future__ import annotations

import json

from benchmarks import cost_calibration_bench


def test_quick_run_reports_both_rules_against_the_truth(tmp_path, capsys):
    out = tmp_path / "r.json"
    cost_calibration_bench.main(["--quick", "--json", "--out", str(out)])
    summary = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == summary
    rate, local = summary["prefill_rate"], summary["local_estimate"]
    assert rate["true_tok_s"] > 0 and local["actual_s"] > 0
    # by construction the wall rule sees a prompt's shared steps as its own: it rates the worker slower
    assert rate["wall"] < rate["compute"]
    assert all(r["wall"] > 0 and r["compute"] > 0 for r in (rate, local))
    assert "compute share (now)" in cost_calibration_bench.table(summary)
