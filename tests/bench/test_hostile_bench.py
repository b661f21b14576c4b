"""The hostile-client benchmark runs end to end (tiny model, small numbers): the huge prompt is refused, every
slow-header connection is closed by the server and the next request served, every stalled stream is
cancelled with its blocks back, the tenant over its quota is refused while served up to it, the low-class
burst is served, and each attack's victim is compared with the victim alone."""

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
                 "--probes", "3", "--flood-threads", "4", "--flood-quota", "2", "--flood-prompt", "300",
                 "--flood-ramp", "1", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["baseline_stream_itl"]["n"] == 47
    assert summary["baseline_probe_ttft"]["n"] == 3
    (huge,), (loris,), (stalled,), (flood,), (burst,) = (
        summary[k]["rounds"] for k in ("huge", "slowloris", "stalled", "tenants", "priority"))
    assert huge["status"] == 400
    assert loris == {"connections": 100, "closed_by_server": 100, "next_request_status": 200}
    assert stalled["cancelled"] == 2 and stalled["blocks_held"] > 0
    assert stalled["blocks_back_s_after_first_tokens"] is not None
    # 4 threads against a quota of 2: some are refused (RESOURCE_EXHAUSTED), the rest served, nothing else
    assert flood["refused"] > 0 and flood["served"] > 0 and flood["errors"] == []
    assert burst["refused"] == 0 and burst["served"] > 0 and burst["errors"] == []
    assert summary["priority"]["step_ms"] > 0
    assert all(summary[k]["p99_over_baseline"] > 0 for k in ("huge", "slowloris", "stalled", "tenants",
                                                              "priority"))
