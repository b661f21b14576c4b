"""`pdserve bench` against real deployments of the tiny random model: every request sent is accounted for."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from benchmarks.serving.cli import main as bench
from benchmarks.serving.client import run_load
from benchmarks.serving.load import Load
from benchmarks.serving.workloads import Vocab, chat
from control.cli import main as pdserve
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import running_server

TINY_VOCAB = Vocab.for_model(320)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(ray_cluster):
    with running_server(model="tiny-random", prefill_workers=1, decode_workers=1, max_model_len=512) as s:
        yield s


def test_bench_counts_every_request_it_sent_and_writes_table_json_and_figure(server, tmp_path, capsys):
    out = tmp_path / "run"
    rc = pdserve(["bench", "--server", server.address, "--workload", "chat", "--rate", "20",
                  "--num-requests", "12", "--warmup", "1", "--goodput", "--goodput-probes", "2",
                  "--ttft-slo", "10", "--itl-slo", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "12/12" in table and "1p1d@" in table

    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["command"].startswith("pdserve bench --server")
    (run,) = doc["runs"]
    s = run["summary"]
    sent = chat().requests(12, 0, TINY_VOCAB)
    assert (s["num_sent"], s["num_completed"], s["num_failed"]) == (12, 12, 0)
    assert s["num_output_tokens"] == sum(r.max_tokens for r in sent)  # ignore_eos: exact lengths
    assert s["num_prompt_tokens"] == sum(r.num_prompt_tokens for r in sent)
    assert s["slo_attainment"] == 1.0 and s["ttft"]["p50"] > 0 and s["itl"]["p99"] >= s["itl"]["p50"]
    # generous SLOs on a tiny model: the search doubles the rate; both probes count 12 requests each
    assert [p["rate"] for p in run["goodput"]["probes"]] == [20, 40]
    assert all(p["summary"]["num_sent"] == 12 == p["summary"]["num_completed"] for p in run["goodput"]["probes"])
    assert run["goodput"]["rate"] == 40 and run["goodput"]["upper"] is None
    assert len(run["quantiles"]["itl_s"]) == 101
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    reports = server.wait_idle()  # nothing left behind by the bench's 36 streams
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values())


def test_bench_drives_the_openai_http_door_with_the_same_workloads(server, tmp_path, capsys):
    out = tmp_path / "openai"
    url = f"http://127.0.0.1:{server.server.http_port}"
    rc = pdserve(["bench", "--backend", "openai", "--server", url, "--workload", "chat", "--concurrency", "4",
                  "--num-requests", "8", "--warmup", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "8/8" in capsys.readouterr().out
    (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
    s = run["summary"]
    sent = chat().requests(8, 0, TINY_VOCAB)
    assert (s["num_sent"], s["num_completed"], s["num_failed"]) == (8, 8, 0)
    assert s["num_output_tokens"] == sum(r.max_tokens for r in sent)  # one SSE chunk per token
    assert s["ttft"]["p50"] > 0 and s["itl"]["p99"] >= s["itl"]["p50"]
    reports = server.wait_idle()
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values())


def test_closed_loop_keeps_its_concurrency_and_each_stream_is_exact(server):
    specs = chat().requests(9, 5, TINY_VOCAB)

    async def go():
        async with grpc.aio.insecure_channel(server.address) as channel:
            return await run_load(pb_grpc.GenerationStub(channel), specs, Load(concurrency=3, num_requests=9),
                                  id_prefix="closed")

    result = asyncio.run(go())
    assert [r.index for r in result.records] == list(range(9))
    for rec, spec in zip(result.records, specs):
        assert rec.ok, rec.error
        assert rec.num_output_tokens == spec.max_tokens and rec.finish_reason == "FINISH_REASON_LENGTH"
        assert len(rec.itls) == spec.max_tokens - 1
        assert rec.prefill_worker == "prefill-0" and rec.decode_worker == "decode-0"
    # never more than 3 in flight: the 4th request is sent only after one of the first 3 finished
    first_done = min(r.done_at for r in result.records[:3])
    assert result.records[3].sent_at >= first_done


def test_launch_starts_a_layout_in_process_and_stops_it(ray_cluster, tmp_path):
    out = tmp_path / "launch"
    assert bench(["--launch", "1c:round-robin", "--model", "tiny-random", "--max-model-len", "512",
                  "--workload", "chat", "--concurrency", "2", "--num-requests", "6", "--warmup", "0",
                  "--out", str(out), "--no-progress"]) == 0
    (run,) = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert run["layout"] == "1c:round-robin" and run["description"] == "1 colocated worker, round-robin routing"
    assert run["summary"]["num_sent"] == 6 == run["summary"]["num_completed"]


def test_bad_arguments_fail_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        bench(["--launch", "3x", "--model", "tiny-random"])
    assert "expected NpMd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench(["--launch", "1p1d", "--goodput", "--concurrency", "2"])
    assert "--goodput searches open-loop rates" in capsys.readouterr().err


def test_a_run_stops_early_when_asked_and_cancels_what_is_in_flight(server):
    specs = chat().requests(30, 6, TINY_VOCAB)

    async def go():
        async with grpc.aio.insecure_channel(server.address) as channel:
            return await run_load(pb_grpc.GenerationStub(channel), specs, Load(rate=4, num_requests=30),
                                  id_prefix="early", stop_when=lambda recs, planned, now: len(recs) >= 3)

    result = asyncio.run(go())
    assert result.stopped_early and 3 <= len(result.records) < 30
    cancelled = [r for r in result.records if not r.ok]
    assert all("already failed" in r.error for r in cancelled)
    reports = server.wait_idle()  # cancelled streams free their blocks
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values())
