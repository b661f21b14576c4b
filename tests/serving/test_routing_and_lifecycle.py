"""Routing, cancellation, load and bad input against a real deployment of the tiny random model."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.pdserve.v1 import generation_pb2 as pb
from tests.serving.conftest import greedy_request, running_server, token_ids

# real worker actors on a local Ray cluster: the default suite runs it, the fast lane (`-m "not slow"`) does not
pytestmark = pytest.mark.slow

LONG_PREFIX = [(13 * i + 7) % 250 for i in range(96)]  # 6 full blocks


@pytest.fixture(scope="module")
def server(ray_cluster):
    # 2 prefill workers so routing has a choice; few decode blocks so admission control is exercised
    with running_server(model="tiny-random", prefill_workers=2, decode_workers=1, num_blocks=48,
                        max_model_len=512, max_queue=400) as s:
        yield s


def test_requests_sharing_a_prefix_land_on_the_worker_that_holds_it(server):
    first = server.generate(greedy_request(LONG_PREFIX + [1, 2, 3], 4))[-1]
    holder = first.prefill_worker_id
    for tail in ([4, 5], [6, 7, 8], [9], [10, 11, 12, 13]):
        last = server.generate(greedy_request(LONG_PREFIX + tail, 4))[-1]
        assert last.prefill_worker_id == holder
        assert last.usage.cached_prompt_tokens == 96
    assert server.generate(greedy_request(LONG_PREFIX + [1, 2, 3], 4))[-1].usage.cached_prompt_tokens == 96


def test_unrelated_requests_spread_over_both_prefill_workers(server):
    prompts = [[(p * 31 + i) % 250 for i in range(200)] for p in range(6)]
    with ThreadPoolExecutor(6) as pool:
        lasts = list(pool.map(lambda p: server.generate(greedy_request(p, 2))[-1], prompts))
    assert {r.prefill_worker_id for r in lasts} == {"prefill-0", "prefill-1"}


def test_cancel_mid_stream_frees_every_block(server):
    call = server.stub.Generate(greedy_request(LONG_PREFIX, 400, ignore_eos=True), timeout=60)
    got = 0
    for _ in call:
        got += 1
        if got == 3:
            call.cancel()
            break
    assert got == 3
    reports = server.wait_idle()
    for wid, r in reports.items():
        assert r.load.free_blocks == r.load.total_blocks, (wid, r.load)
        assert r.load.num_running == 0


def test_client_deadline_frees_every_block(server):
    # NOTE: 400 tokens take >= 0.2 s even on an idle machine (>= 0.5 ms a step), so a 0.1 s deadline always
    # expires while the request holds blocks somewhere: reserved, prefilling, or decoding.
    with pytest.raises(grpc.RpcError) as err:
        for _ in server.stub.Generate(greedy_request(LONG_PREFIX, 400, ignore_eos=True), timeout=0.1):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reports = server.wait_idle()
    for wid, r in reports.items():
        assert r.load.free_blocks == r.load.total_blocks, (wid, r.load)
        assert r.load.num_running == 0


def test_200_concurrent_requests_all_finish_and_free_their_blocks(server):
    n = 200
    results: list[object] = [None] * n
    barrier = threading.Barrier(20)

    def one(i: int) -> None:
        if i < 20:
            barrier.wait(10)  # a real burst at the start
        prompt = LONG_PREFIX[: 10 + (i * 7) % 80] + [i % 250]
        try:
            results[i] = server.generate(greedy_request(prompt, 3 + i % 12, ignore_eos=True), timeout=240)
        except grpc.RpcError as e:
            results[i] = e

    with ThreadPoolExecutor(50) as pool:  # 50 in flight at a time on 48 decode blocks
        list(pool.map(one, range(n)))
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors), errors[:3]
    done = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert len(done) >= n * 0.9
    for i, r in enumerate(results):
        if not isinstance(r, grpc.RpcError):
            assert len(token_ids(r)) == 3 + i % 12
            assert r[-1].finish_reason == pb.FINISH_REASON_LENGTH
    reports = server.wait_idle()
    for wid, rep in reports.items():
        assert rep.load.free_blocks == rep.load.total_blocks, (wid, rep.load)


def _prompt(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=4, temperature=0))


def _with(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(**sampling))


def _msgs(*pairs) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))
    req.messages.SetInParent()
    for role, content in pairs:
        req.messages.messages.append(pb.ChatMessage(role=role, content=content))
    return req


def _ids(ids) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))
    req.prompt_token_ids.SetInParent()
    req.prompt_token_ids.ids.extend(ids)
    return req


BAD = [
    (pb.GenerateRequest(), "input"),
    (_prompt(""), "prompt"),
    (_prompt("x" * 600), "prompt"),  # 600 byte tokens > max_model_len 512
    (_ids([]), "prompt_token_ids"),
    (_ids([1, 2, 999]), "prompt_token_ids"),
    (_ids([5] * 512), "prompt_token_ids"),
    (_msgs(), "messages"),
    (_msgs(("wizard", "hi")), "role"),
    (_msgs(("USER", "hi")), "role"),
    (_with(temperature=-1.0), "sampling.temperature"),
    (_with(temperature=math.nan), "sampling.temperature"),
    (_with(temperature=math.inf), "sampling.temperature"),
    (_with(temperature=1000.0), "sampling.temperature"),
    (_with(top_p=0.0), "sampling.top_p"),
    (_with(top_p=1.5), "sampling.top_p"),
    (_with(top_p=math.nan), "sampling.top_p"),
    (_with(top_k=100000), "sampling.top_k"),
    (_with(max_tokens=10**6), "sampling.max_tokens"),
    (_with(max_tokens=510), "sampling.max_tokens"),  # prompt + max_tokens > context
    (_with(stop=[""]), "sampling.stop"),
    (_with(stop=["s"] * 100), "sampling.stop"),
    (_with(stop_token_ids=[10**6]), "sampling.stop_token_ids"),
    (pb.GenerateRequest(request_id="bad id\n", prompt="hi"), "request_id"),
    (pb.GenerateRequest(request_id="x" * 1000, prompt="hi"), "request_id"),
]


@pytest.mark.parametrize("request_, field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(server, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        server.generate(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_server_keeps_serving_after_bad_input_and_frees_everything(server):
    assert len(token_ids(server.generate(greedy_request("still alive", 5)))) == 5
    reports = server.wait_idle()
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values())


def test_duplicate_request_id_in_flight_is_refused(server):
    req = greedy_request(LONG_PREFIX, 200, ignore_eos=True)
    req.request_id = "dup-1"
    first = server.stub.Generate(req, timeout=60)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        server.generate(req)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in err.value.details()
    first.cancel()
    server.wait_idle()


def test_stop_string_ends_the_stream_and_frees_blocks(server):
    free = server.generate(greedy_request("stop strings", 30, ignore_eos=True))
    text = "".join(r.text for r in free)
    stop = text[5:7]
    assert stop
    cut = server.generate(greedy_request("stop strings", 30, ignore_eos=True, stop=[stop]))
    assert "".join(r.text for r in cut) == text[:text.index(stop)]
    assert cut[-1].finish_reason == pb.FINISH_REASON_STOP
    reports = server.wait_idle()
    assert all(r.load.free_blocks == r.load.total_blocks for r in reports.values())


def test_model_info_lists_the_pools(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_name == "tiny-random" and info.max_model_len == 512 and info.block_size == 16
    pools = {pb.PoolKind.Name(p.kind): sorted(w.worker_id for w in p.workers) for p in info.pools}
    assert pools == {"POOL_KIND_PREFILL": ["prefill-0", "prefill-1"], "POOL_KIND_DECODE": ["decode-0"]}


def test_health_is_serving(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(server.channel)
    res = stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"))
    assert res.status == health_pb2.HealthCheckResponse.SERVING


def test_server_reflection_lists_and_describes_the_service(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(server.channel)
    services = set(db.get_services())
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services
    desc = db.FindFileContainingSymbol("pdserve.v1.Generation")
    assert desc.name == "pdserve/v1/generation.proto"
    assert {m.name for m in desc.service[0].method} == {"Generate", "GetModelInfo"}


def test_a_request_id_reused_right_after_a_cancel_carries_only_its_own_tokens(server):
    prompt_a, prompt_b = LONG_PREFIX[:40], [(5 * i + 3) % 250 for i in range(40)]
    want_b = token_ids(server.generate(greedy_request(prompt_b, 24, ignore_eos=True)))
    server.wait_idle()
    call = server.stub.Generate(pb.GenerateRequest(
        request_id="reused", prompt_token_ids=pb.TokenIds(ids=prompt_a),
        sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)), timeout=60)
    next(call)
    call.cancel()
    again = pb.GenerateRequest(request_id="reused", prompt_token_ids=pb.TokenIds(ids=prompt_b),
                               sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    responses = server.generate(again)
    assert token_ids(responses) == want_b
    assert all(r.request_id == "reused" for r in responses)
    reports = server.wait_idle()
    for wid, r in reports.items():
        assert r.load.free_blocks == r.load.total_blocks and r.load.num_running == 0, (wid, r.load)


def test_graceful_shutdown_finishes_the_stream_in_flight_and_refuses_new_ones(ray_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with running_server(model="tiny-random", num_blocks=64, max_model_len=512) as s:
        call = s.stub.Generate(greedy_request(LONG_PREFIX[:20], 200, ignore_eos=True), timeout=60)
        got = list(next(call).token_ids)
        stopping = threading.Thread(target=lambda: s.run(s.server.shutdown(grace_s=30), timeout=60))
        stopping.start()
        health = health_pb2_grpc.HealthStub(s.channel)
        for _ in range(100):
            if health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            threading.Event().wait(0.02)
        with pytest.raises(grpc.RpcError) as e:
            s.generate(greedy_request([1, 2, 3], 4))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        for r in call:
            got += r.token_ids
        assert len(got) == 200  # the stream in flight finished
        stopping.join(60)
        assert not stopping.is_alive()
        import ray

        for w in s.server.registry.workers.values():  # nothing left running
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(w.client.actor.ping.remote(), timeout=30)


def test_a_rendezvous_store_that_cannot_listen_fails_the_start_naming_it_and_stops_the_workers(
        ray_cluster, monkeypatch):
    """The store starts beside the workers, on a port chosen before either: taken in the meantime (here, by
    this test), the start fails naming the store and its address, and what it had started is stopped."""
    import asyncio
    import socket

    import ray

    import control.shared
    from control.config import ServeConfig
    from control.console import ServeError
    from control.server import Server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(control.shared, "_free_port", lambda host: port)
        server = Server(ServeConfig(model="tiny-random", prefill_workers=1, decode_workers=1, num_blocks=32,
                                    port=0, metrics_port=None, http_port=None, worker_threads=1))

        async def start_then_stop():
            try:
                await server.start()
            finally:
                await server.stop()

        with pytest.raises(ServeError, match=f"the KV rendezvous store did not start at 127.0.0.1:{port}"):
            asyncio.run(start_then_stop())
    assert server._launched, "the workers started beside the store"
    for actor in server._launched.values():
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=30)
