"""Elastic pools on a real deployment (SmolLM2, Ray actors, gloo KV moves, the Admin gRPC API): a drained
decode worker's running sequences move with their KV and every stream goes on token for token; pools scale
1 -> 3 -> 1 and roll to new workers under a closed-loop load with no failed request."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine import LLM, SamplingParams
from protos.pdserve.v1 import admin_pb2 as admin
from protos.pdserve.v1 import admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from tests.serving.conftest import greedy_request, running_server, token_ids

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
NUM_STREAMS = 18  # over 2 decode workers: one of them holds at least 9
STREAM_TOKENS = 96
PROMPTS = [f"Chapter {i}. The {w} of the old lighthouse keeper began on a stormy night when"
           for i, w in enumerate(["story", "diary", "legend", "secret", "voyage", "letters"] * 3)]
LOOP_PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Water boils at"]
LOOP_TOKENS = 24


@pytest.fixture(scope="module")
def references() -> dict[str, list[int]]:
    llm = LLM(MODEL, num_blocks=512)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True))
    loop = llm.generate(LOOP_PROMPTS, SamplingParams(max_tokens=LOOP_TOKENS, temperature=0, ignore_eos=True))
    return {p: o.token_ids for p, o in zip(PROMPTS + LOOP_PROMPTS, outs + loop)}


@pytest.fixture(scope="module")
def server(ray_cluster):
    with running_server(model=MODEL, prefill_workers=1, decode_workers=2, num_blocks=256,
                        verify_kv_moves=True) as s:
        s.admin = admin_pb2_grpc.AdminStub(s.channel)
        yield s


def _workers(server, pool: int) -> list[admin.WorkerStatus]:
    return [w for w in server.admin.ListWorkers(admin.ListWorkersRequest(), timeout=10).workers if w.pool == pool]


def _metric(server, name: str, **labels) -> float:
    return sum(s.value for fam in server.server.metrics.registry.collect() for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_refused_admin_calls_name_the_field_and_change_nothing(server):
    for call, request, code, words in (
            (server.admin.ScalePool, admin.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=0),
             grpc.StatusCode.INVALID_ARGUMENT, "num_workers"),
            (server.admin.ScalePool, admin.ScalePoolRequest(pool=pb.POOL_KIND_COLOCATED, num_workers=2),
             grpc.StatusCode.INVALID_ARGUMENT, "pool"),
            (server.admin.DrainWorker, admin.DrainWorkerRequest(worker_id="decode-9"),
             grpc.StatusCode.NOT_FOUND, "worker_id"),
            (server.admin.DrainWorker, admin.DrainWorkerRequest(), grpc.StatusCode.INVALID_ARGUMENT, "worker_id"),
            (server.admin.DrainWorker, admin.DrainWorkerRequest(worker_id="prefill-0"),
             grpc.StatusCode.FAILED_PRECONDITION, "last serving prefill")):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=30)
        assert e.value.code() == code and words in e.value.details(), (code, e.value.details())
    pools = {p.pool: (p.target, p.serving) for p in server.admin.ListWorkers(admin.ListWorkersRequest()).pools}
    assert pools == {pb.POOL_KIND_PREFILL: (1, 1), pb.POOL_KIND_DECODE: (2, 2)}


def test_draining_a_decode_worker_moves_its_sequences_kv_and_every_stream_goes_on_exactly(server, references):
    results: dict[str, list[pb.GenerateResponse]] = {}
    started = threading.Barrier(NUM_STREAMS + 1)

    def stream(prompt: str) -> None:
        got = []
        for n, res in enumerate(server.stub.Generate(greedy_request(prompt, STREAM_TOKENS, ignore_eos=True),
                                                     timeout=300)):
            got.append(res)
            if n == 1:
                started.wait(120)  # decoding: the second message came from the decode worker
        results[prompt] = got

    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS]
        started.wait(120)
        # every stream is decoding: drain the decode worker holding the most
        holding = {}
        deadline = time.monotonic() + 10
        while sum(holding.values()) < NUM_STREAMS and time.monotonic() < deadline:
            holding = {w.worker_id: w.num_running for w in _workers(server, pb.POOL_KIND_DECODE)}
            time.sleep(0.1)
        victim = max(holding, key=holding.get)
        assert holding[victim] >= NUM_STREAMS // 2, holding
        out = server.admin.DrainWorker(admin.DrainWorkerRequest(worker_id=victim), timeout=300)
        for f in futures:
            f.result()

    # every stream went on from where it was, token for token, and the ones that moved ended elsewhere
    for prompt in PROMPTS:
        assert token_ids(results[prompt]) == references[prompt], prompt
    moved = [p for p in PROMPTS if results[p][-1].decode_worker_id != victim]
    assert out.clean and out.worker_id == victim
    assert out.moved_kv >= NUM_STREAMS // 2 and out.moved_recompute == 0, out
    assert out.blocks_held_at_exit == 0
    assert len(moved) == NUM_STREAMS  # the survivor finished every stream
    # the moved KV equals its source bit for bit (SHA-256 of every layer's K and V at both ends)
    moves = [m for m in server.server.router.kv_moves if m.src == victim]
    assert len(moves) == out.moved_kv
    assert all(m.result.ok and m.src_digest == m.dst_digest is not None and m.result.num_bytes for m in moves)
    # nothing was prefilled again: the prefill worker computed each prompt once
    assert _metric(server, "pdserve_request_migrations_total", cause="drain", method="kv") == out.moved_kv
    assert _metric(server, "pdserve_request_migrations_total", method="recompute") == 0
    assert _metric(server, "pdserve_migration_pause_seconds_count", method="kv") == out.moved_kv
    assert _metric(server, "pdserve_kv_moved_bytes_total", src=victim) == sum(m.result.num_bytes for m in moves)
    # the pool shrank; no block leaked anywhere
    pools = {p.pool: p for p in server.admin.ListWorkers(admin.ListWorkersRequest(), timeout=10).pools}
    assert (pools[pb.POOL_KIND_DECODE].target, pools[pb.POOL_KIND_DECODE].serving) == (1, 1)
    reports = server.wait_idle()
    assert victim not in reports
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports


class ClosedLoop:
    """A few clients, each sending its next request as soon as the last one ended, until stopped."""

    def __init__(self, server, num_clients: int) -> None:
        self.server = server
        self.responses: list[tuple[str, list[pb.GenerateResponse], float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(num_clients)]
        for t in self._threads:
            t.start()

    def _client(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            prompt = LOOP_PROMPTS[k % len(LOOP_PROMPTS)]
            k += 1
            try:
                got = self.server.generate(greedy_request(prompt, LOOP_TOKENS, ignore_eos=True), timeout=300)
                self.responses.append((prompt, got, time.monotonic()))
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(300)


def test_scale_1_to_3_to_1_and_a_rolling_restart_under_load_fail_no_request(server, references):
    decode_before = {w.worker_id for w in _workers(server, pb.POOL_KIND_DECODE)}
    assert len(decode_before) == 1  # the previous test drained one of two
    load = ClosedLoop(server, 3)
    try:
        up = server.admin.ScalePool(admin.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=3), timeout=600)
        ready_at = time.monotonic()
        assert len(up.started) == 2 and up.pool.serving == 3
        # placement uses the new workers as soon as they are ready
        deadline = time.monotonic() + 30
        while not set(up.started) <= {r[-1].decode_worker_id for _, r, t in load.responses if t > ready_at}:
            assert time.monotonic() < deadline, "the new decode workers took no traffic"
            time.sleep(0.05)
        down = server.admin.ScalePool(admin.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=1), timeout=600)
        assert len(down.retired) == 2 and (down.pool.serving, down.pool.target) == (1, 1)
        restart = server.admin.RestartPool(admin.RestartPoolRequest(pool=pb.POOL_KIND_DECODE), timeout=600)
        (drained,) = restart.drained
        assert drained.clean and drained.replacement and drained.blocks_held_at_exit == 0
        restart = server.admin.RestartPool(admin.RestartPoolRequest(pool=pb.POOL_KIND_PREFILL), timeout=600)
        assert restart.drained[0].clean and restart.drained[0].moved_kv == 0
        time.sleep(1.0)
    finally:
        load.stop()
    assert not load.errors, load.errors[:3]
    assert len(load.responses) >= 10
    for prompt, got, _ in load.responses:
        assert token_ids(got) == references[prompt], prompt
    serving = {w.worker_id for w in _workers(server, pb.POOL_KIND_DECODE)}
    assert len(serving) == 1 and not serving & decode_before  # every decode worker is a new one
    assert [w.worker_id for w in _workers(server, pb.POOL_KIND_PREFILL)] == ["prefill-1"]
    reports = server.wait_idle()
    assert set(reports) == serving | {"prefill-1"}
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values()), reports
    assert _metric(server, "pdserve_workers_lost_total") == 0  # retired, not lost
