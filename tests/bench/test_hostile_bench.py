"""The hostile-client benchmark runs end to end (tiny model, small numbers): the huge prompt is refused, every
slow-header connection is closed by the server and the next request served, every stalled stream is
cancelled with its blocks back, and each attack's gaps are compared with the stream alone."""

from __future__ import annotations

import json

import pytest

from benchmarks.hostile_bench import main

pytestmark = pytest.mark.slow


def test_hostile_bench_reports_each_attack_and_what_the_server_freed(ray_cluster, tmp_path):
    out = tmp_path / "hostile.json"
    assert main(["--model", "tiny-random", "--rounds", "1", "--stream-tokens", "48", "--slowloris", "100",
                 "--huge-chars", "100000", "--stalled", "2", "--stalled-prompt", "200",
                 "--stalled-max-tokens", "700", "--stall-timeout", "2", "--header-timeout", "1",
                 "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["baseline"]["gaps"] == 47
    (huge,), (loris,), (stalled,) = (summary[k]["rounds"] for k in ("huge", "slowloris", "stalled"))
    assert huge["status"] == 400
    assert loris == {"connections": 100, "closed_by_server": 100, "next_request_status": 200}
    assert stalled["cancelled"] == 2 and stalled["blocks_held"] > 0
    assert stalled["blocks_back_s_after_first_tokens"] is not None
    assert all(summary[k]["p99_over_baseline"] > 0 for k in ("huge", "slowloris", "stalled"))
