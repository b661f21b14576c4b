"""A real Prometheus scraping a real deployment under a small load: every dashboard query returns data, and
the TTFT/ITL histogram counts are what the clients saw."""

from __future__ import annotations

import collections
import json
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from control.config import AutoscaleConfig
from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.cost_model import CostPriors
from router.security import ClientSecurity
from tests.observability.dashboard import load_dashboard, substitute, targets
from tests.observability.prometheus import PROMETHEUS, Prometheus, wait_for
from tests.serving.conftest import greedy_request, running_server, token_ids

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary on PATH: install the Debian package "
                       "(apt-get install -y prometheus), as .ci/run does"),
]

MODEL = "tiny-random"
PLANNER_PROFILE = Path(__file__).resolve().parents[2] / "benchmarks/results/planner/profile-smollm2-cpu.json"
PREFIX = [(13 * i + 7) % 250 for i in range(48)]  # 3 full blocks shared by half the prompts: prefix-cache hits
NUM_LOAD = 24
SPEC_PROMPT = [10, 11, 12, 13, 146, 14, 15, 16, 17, 13]
NUM_CANCELLED = 4
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
# the load runs as an admin tenant without limits; a capped tenant's too-long prompt is refused at the door
LOAD_KEY, CAPPED_KEY = "sk-load-key-0001", "sk-capped-key-01"
KEYS = {"tenants": {"load": {}, "capped": {"max_queued_prompt_tokens": 8}},
        "keys": [{"key": LOAD_KEY, "tenant": "load", "role": "admin"},
                 {"key": CAPPED_KEY, "tenant": "capped", "role": "client"}]}


@dataclass
class Seen:
    """What the clients saw, and what Prometheus said after scraping it."""

    streams: int = 0  # streams that got at least one token
    gaps: int = 0  # sum over streams of (tokens - 1)
    reasons: collections.Counter = field(default_factory=collections.Counter)
    prom: dict[str, float] = field(default_factory=dict)

    def add(self, num_tokens: int, reason: str) -> None:
        if num_tokens:
            self.streams += 1
            self.gaps += num_tokens - 1
        self.reasons[reason] += 1


@dataclass
class Load:
    completed: Seen  # warm-up and load: every stream ran to its end
    all: Seen  # ... and then streams the clients cancelled
    workers: list[str]


def snapshot(prom: Prometheus) -> dict[str, float]:
    return {
        "ttft": prom.scalar("sum(pdserve_time_to_first_token_seconds_count)"),
        "ttft_prefill_0": prom.scalar('sum(pdserve_time_to_first_token_seconds_count{pool="prefill", '
                                      'worker="prefill-0"})'),
        "itl": prom.scalar("sum(pdserve_inter_token_latency_seconds_count)"),
        "itl_decode_0": prom.scalar('sum(pdserve_inter_token_latency_seconds_count{pool="decode", '
                                    'worker="decode-0"})'),
        "generated": prom.scalar("sum(pdserve_generation_tokens_total)"),
        **{f"requests_{r['metric']['finish_reason']}": float(r["value"][1])
           for r in prom.query("sum by (finish_reason) (pdserve_requests_total)")},
    }


def settle(prom: Prometheus, seen: Seen) -> None:
    """Wait until Prometheus scraped after everything the clients saw, then take its numbers."""
    prom.wait_scraped_after(time.time())
    seen.prom = snapshot(prom)


@pytest.fixture(scope="module")
def deployment(ray_cluster, tmp_path_factory):
    # NOTE: with speculation on, so the dashboard's speculative-decoding panels have data too; and with every
    # transfer rating its link (tiny-random's prompts carry a few KB of KV, far under the 1 MiB floor), so
    # the cost model's link panel does
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # and with the autoscaler advising every 2 s, so its panels have data (it changes nothing)
    slo = keys.parent / "slo.json"
    slo.write_text(json.dumps({"ttft_s": 1.0, "itl_s": 0.1}))
    autoscale = AutoscaleConfig(str(slo), str(PLANNER_PROFILE), interval_s=2.0, apply=False)
    with running_server(model=MODEL, prefill_workers=1, decode_workers=1, metrics_port=0, max_model_len=512,
                        speculative="ngram", cost_priors=CostPriors(min_rated_transfer_bytes=1),
                        api_keys=str(keys), client_key=LOAD_KEY, autoscale=autoscale) as server:
        assert server.server.metrics_port
        prom = Prometheus(f"127.0.0.1:{server.server.metrics_port}", tmp_path_factory.mktemp("prometheus"))
        try:
            yield server, prom
        finally:
            prom.close()


@pytest.fixture(scope="module")
def load(deployment) -> Load:
    server, prom = deployment
    seen = Seen()

    def run(req: pb.GenerateRequest) -> None:
        responses = server.generate(req, timeout=120)
        seen.add(len(token_ids(responses)), FINISH[responses[-1].finish_reason])

    # Warm-up: one stream of each kind, so every series exists in Prometheus before the load moves it
    # (rate() needs two samples; a series first scraped after the whole load would show no rate).
    probe = PREFIX + [1, 2, 3]
    first = server.generate(greedy_request(probe, 12, ignore_eos=True))
    run(greedy_request(PREFIX + [4], 1))  # the first token ends it: TTFT, no ITL
    text = "".join(r.text for r in first)
    seen.add(len(token_ids(first)), FINISH[first[-1].finish_reason])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    settle(prom, seen)

    requests = []
    for i in range(NUM_LOAD):
        if i % 4 == 1 and stop:  # the probe's prompt again, cut short by a stop string from its own text
            requests.append(greedy_request(probe, 12, ignore_eos=True, stop=[stop]))
            continue
        prompt = (PREFIX if i % 2 else []) + [(37 * i + j) % 250 for j in range(5 + i % 7)]
        if i == 2:
            # tiny-random's first token here is 146, and (13, 146) occurs earlier in the prompt: drafts are
            # proposed at its first decode step
            requests.append(greedy_request(SPEC_PROMPT, 6, ignore_eos=True))
            continue
        requests.append(greedy_request(prompt, 1 + i % 10, ignore_eos=i % 3 == 0))
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(run, requests))
    completed = Seen(seen.streams, seen.gaps, collections.Counter(seen.reasons))
    settle(prom, completed)

    lock = threading.Lock()

    def cancelled(i: int) -> None:
        call = server.stub.Generate(greedy_request([(11 * i + j) % 250 for j in range(20)], 400,
                                                   ignore_eos=True), timeout=60)
        got = 0
        for n, res in enumerate(call, 1):
            got += len(res.token_ids)
            if n == 2:
                call.cancel()
                break
        with lock:
            seen.add(got, "cancelled")

    with ThreadPoolExecutor(NUM_CANCELLED) as pool:
        list(pool.map(cancelled, range(NUM_CANCELLED)))
    # the server learns of a cancel after the client: wait until Prometheus has seen every one end
    wait_for("the cancelled streams' ends in Prometheus",
             lambda: prom.scalar('sum(pdserve_requests_total{finish_reason="cancelled"})') == NUM_CANCELLED, 30)
    settle(prom, seen)
    _refused_by_quota(server)
    _scale_and_drain(server, prom)
    return Load(completed, seen, sorted(server.server.router.workers))


def _refused_by_quota(server) -> None:
    """The capped tenant's 20-token prompt is over its 8 queued prompt tokens: refused before any prefill (the
    quota panel's data; not a request, so no count above moves)."""
    with ClientSecurity(api_key=CAPPED_KEY).channel(server.address) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.GenerationStub(channel).Generate(greedy_request(list(range(1, 21)), 4), timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "max_queued_prompt_tokens" in refused.value.details()


def _scale_and_drain(server, prom: Prometheus) -> None:
    """An operator's turn, after the counts above were taken: a second decode worker joins, then the one
    decoding a long stream is drained, so its sequence moves with its KV (the elastic-pool panels' data)."""
    admin_stub = admin_pb2_grpc.AdminStub(server.channel)
    admin_stub.ScalePool(admin_pb2.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=2), timeout=300)
    prom.wait_scraped_after(time.time() + 1.0)  # the new pair's zero series, before anything moves
    call = server.stub.Generate(greedy_request(PREFIX[:20], 480, ignore_eos=True), timeout=120)
    for n, _ in enumerate(call, 1):
        if n == 2:
            holder = next(w.worker_id for w in admin_stub.ListWorkers(admin_pb2.ListWorkersRequest()).workers
                          if w.pool == pb.POOL_KIND_DECODE and w.num_running)
            moved = admin_stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=holder), timeout=120)
            assert moved.moved_kv == 1, moved
    # the drained worker is gone, and the cost model forgot its links: one prompt over the remaining pair
    assert len(token_ids(server.generate(greedy_request(PREFIX[:40], 4, ignore_eos=True)))) == 4
    prom.wait_scraped_after(time.time())


def test_ttft_and_itl_counts_equal_what_the_clients_saw(load):
    seen, prom = load.completed, load.completed.prom
    assert seen.streams == NUM_LOAD + 2
    assert prom["ttft"] == prom["ttft_prefill_0"] == seen.streams  # one TTFT per stream, by its prefill worker
    assert prom["itl"] == prom["itl_decode_0"] == seen.gaps  # one ITL per token gap, by its decode worker
    assert prom["generated"] == seen.streams + seen.gaps
    for reason in ("stop", "length", "cancelled", "error"):
        assert prom[f"requests_{reason}"] == seen.reasons[reason], reason


def test_cancelled_streams_count_once_each_and_their_gaps_stay_consistent(load):
    seen, prom = load.all, load.all.prom
    assert prom["ttft"] == seen.streams == load.completed.streams + NUM_CANCELLED
    assert prom["requests_cancelled"] == NUM_CANCELLED
    # NOTE: a cancelled stream may have had a token in flight the client never read: at least what it saw,
    # and exactly one gap per token the server sent after each stream's first
    assert prom["itl"] >= seen.gaps
    assert prom["itl"] == prom["generated"] - prom["ttft"]


def test_every_dashboard_query_returns_data(deployment, load):
    _, prom = deployment
    dashboard = load_dashboard()
    values = {"model": MODEL, "pool": "prefill|decode", "worker": "|".join(load.workers),
              "__rate_interval": "5m"}
    for v in dashboard["templating"]["list"]:  # what Grafana would list for each query variable
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v.get("definition", ""))
        if m:
            listed = prom.api(f"label/{m[2]}/values", **{"match[]": substitute(m[1], values)})
            expected = {"model": [MODEL], "pool": ["decode", "prefill"], "worker": load.workers}[v["name"]]
            assert sorted(listed) == expected, (v["name"], listed)
    for t in targets(dashboard):
        expr = substitute(t.expr, values)
        result = prom.query(expr)
        assert result, f"{t.panel}/{t.ref_id}: no data for {expr}"
        numbers = [float(r["value"][1]) for r in result]
        assert any(math.isfinite(x) for x in numbers), f"{t.panel}/{t.ref_id}: {expr} gave {numbers}"
