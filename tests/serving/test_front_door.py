"""A front door safe to share, on one real deployment (tiny model, Ray, gRPC and HTTP on loopback): stalled
streams cancelled with every block back while a slow reader is only paused, tenants' keys and roles (the
client key cannot touch the Admin API), quotas refused before prefill, one tenant's cached prompt invisible
to another, and hostile HTTP input (huge bodies, huge integers, lone surrogates, slow headers) a clean 4xx."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from protos.pdserve.v1 import admin_pb2, admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import greedy_request, running_server

pytestmark = pytest.mark.slow

ADMIN, ALICE, BOB = "sk-admin-key-0001", "sk-alice-key-0001", "sk-bob-key-00001"
KEYS = {
    "tenants": {"ops": {}, "alice": {"max_concurrent_requests": 1, "max_queued_prompt_tokens": 600},
                "bob": {}},
    "keys": [{"key": ADMIN, "tenant": "ops", "role": "admin"},
             {"key": ALICE, "tenant": "alice", "role": "client"},
             {"key": BOB, "tenant": "bob", "role": "client"}],
}
STALL_S = 2.0
PER_CLIENT = 64  # the HTTP door's connections per client address
PROMPT = list(range(1, 200))  # 13 full blocks


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with running_server(model="tiny-random", num_blocks=128, max_model_len=1024, api_keys=str(keys),
                        stalled_stream_timeout=STALL_S, http_header_timeout=1.0,
                        http_max_connections_per_client=PER_CLIENT) as s:
        s.keys_file = keys
        yield s


def used_blocks(server) -> dict[str, int]:
    return {w: r.load.total_blocks - r.load.free_blocks for w, r in server.reports().items()}


def stalled_total(server, door: str) -> float:
    return server.server.observer.stalled.labels("tiny-random", door)._value.get()


def wait_blocks_back(server, timeout: float) -> float:
    """Seconds until no worker holds a block (fails past `timeout`)."""
    t0 = time.monotonic()
    while any(used_blocks(server).values()):
        assert time.monotonic() - t0 < timeout, f"blocks still held: {used_blocks(server)}"
        time.sleep(0.1)
    return time.monotonic() - t0


def small_window_stub(server) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    # NOTE: a default client's window grows by BDP probing to thousands of messages, so its server never
    # blocks; a 1 KiB stream window (~18 messages) makes the server's hand-over wait on the reader
    ch = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0),
                                                        ("grpc.http2.lookahead_bytes", 1024)])
    return ch, pb_grpc.GenerationStub(ch)


def test_grpc_streams_whose_client_stops_reading_are_cancelled_and_free_every_block(server):
    before = stalled_total(server, "grpc")
    ch, stub = small_window_stub(server)
    calls = [stub.Generate(greedy_request(PROMPT[i:], 700, ignore_eos=True), timeout=60, metadata=md(BOB))
             for i in range(3)]
    for c in calls:
        next(c)  # streaming; then nobody reads
    time.sleep(0.5)
    assert sum(used_blocks(server).values()) > 0
    # meanwhile another client is served
    other = server.stub.Generate(greedy_request([5, 6, 7], 8, ignore_eos=True), timeout=30, metadata=md(ALICE))
    assert sum(len(r.token_ids) for r in other) == 8
    took = wait_blocks_back(server, timeout=4 * STALL_S + 5)
    assert stalled_total(server, "grpc") - before == 3
    print(f"3 stalled gRPC streams: every block back {took:.1f} s after the check began")
    for c in calls:
        c.cancel()
    ch.close()


def test_a_slow_but_moving_grpc_reader_is_paused_never_cancelled(server):
    before = stalled_total(server, "grpc")
    ch, stub = small_window_stub(server)
    got = 0
    t0 = time.monotonic()
    for res in stub.Generate(greedy_request(PROMPT, 120, ignore_eos=True), timeout=120, metadata=md(BOB)):
        got += len(res.token_ids)
        time.sleep(0.05)  # ~20 messages/s: the 1 KiB window is read well within the timeout
    assert got == 120
    assert stalled_total(server, "grpc") == before
    print(f"slow reader: 120 tokens in {time.monotonic() - t0:.1f} s, not cancelled")
    ch.close()
    wait_blocks_back(server, timeout=10)


def test_an_http_stream_whose_socket_stops_reading_is_cancelled(server):
    before = stalled_total(server, "http")
    body = json.dumps({"prompt": PROMPT[:50], "max_tokens": 900, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    # (accepted sockets inherit the listening socket's buffer size; asyncio adds its own 64 KiB)
    server.server.http.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    socks = []
    for _ in range(2):
        # NOTE: on loopback the kernel buffers megabytes of a socket nobody reads; small buffers on both ends
        # make the server's writes wait on this reader within ~400 events
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.server.http_port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + BOB.encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"200 OK" in s.recv(200)
        socks.append(s)
    time.sleep(0.5)
    assert sum(used_blocks(server).values()) > 0
    took = wait_blocks_back(server, timeout=4 * STALL_S + 10)
    assert stalled_total(server, "http") - before == 2
    print(f"2 stalled HTTP streams: every block back {took:.1f} s after the check began")
    for s in socks:
        s.close()


def test_the_client_key_cannot_scale_or_drain_and_an_admin_key_can(server):
    admin = admin_pb2_grpc.AdminStub(server.channel)
    for call, req in ((admin.ScalePool, admin_pb2.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=4)),
                      (admin.DrainWorker, admin_pb2.DrainWorkerRequest(worker_id="decode-0")),
                      (admin.ListWorkers, admin_pb2.ListWorkersRequest())):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10, metadata=md(BOB))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
        assert "admin" in e.value.details()
    listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10, metadata=md(ADMIN))
    assert {w.worker_id for w in listed.workers} == {"prefill-0", "decode-0"}
    scaled = admin.ScalePool(admin_pb2.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=1), timeout=30,
                             metadata=md(ADMIN))
    assert scaled.pool.target == 1
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Generate(greedy_request([1, 2], 2), timeout=10, metadata=md("sk-nobody-00000")).__next__()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_over_its_limits_is_refused_before_prefill_and_another_is_served(server):
    prompt_tokens = server.server.observer.prompt_tokens
    # alice may have 1 request in flight: hold one open, then a second is refused at the door
    held = server.stub.Generate(greedy_request(PROMPT, 300, ignore_eos=True), timeout=60, metadata=md(ALICE))
    next(held)
    before = sum(s.get() for s in _samples(prompt_tokens))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        next(server.stub.Generate(greedy_request([9] * 50, 4), timeout=10, metadata=md(ALICE)))
    refused_in = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests" in e.value.details()
    assert dict(e.value.trailing_metadata()).get("retry-after") == "1"
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/completions",
                                 data=json.dumps({"prompt": "hello", "max_tokens": 2}).encode(),
                                 headers={"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req, timeout=10)
    assert h.value.code == 429 and h.value.headers["retry-after"] == "1"
    assert json.loads(h.value.read())["error"]["code"] == "max_concurrent_requests"
    # bob is not held back by alice's quota
    assert sum(len(r.token_ids) for r in server.stub.Generate(greedy_request([3, 4], 4, ignore_eos=True),
                                                               timeout=30, metadata=md(BOB))) == 4
    held.cancel()
    # a prompt over alice's queued-token limit: refused naming it
    wait_blocks_back(server, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        next(server.stub.Generate(greedy_request([7] * 900, 4), timeout=10, metadata=md(ALICE)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_prompt_tokens=600" in e.value.details()
    # no prompt of a refused request was prefilled: only alice's held one and bob's are counted
    assert sum(s.get() for s in _samples(prompt_tokens)) - before == len(PROMPT) + 2
    print(f"over-quota request refused in {refused_in * 1000:.0f} ms")
    wait_blocks_back(server, timeout=10)


def _samples(counter):
    return [child._value for child in counter._metrics.values()]


def test_one_tenant_cannot_see_another_tenants_cached_prompt(server):
    prompt = [(i * 7) % 250 + 1 for i in range(512)]

    def cached(key: str, salt: str = "") -> int:
        req = greedy_request(prompt, 2, ignore_eos=True)
        req.cache_salt = salt
        return list(server.stub.Generate(req, timeout=60, metadata=md(key)))[-1].usage.cached_prompt_tokens

    assert cached(ALICE) == 0
    assert cached(ALICE) >= 496  # her own prompt: cached
    assert cached(BOB) == 0  # the same prompt under bob's salt: nothing of alice's
    assert cached(BOB) >= 496
    assert cached(BOB, salt="per-request") == 0  # an explicit salt is a cache of its own
    wait_blocks_back(server, timeout=10)


def test_the_key_file_is_reloaded_when_it_changes(server):
    new = "sk-carol-key-0001"
    doc = json.loads(json.dumps(KEYS))
    doc["keys"].append({"key": new, "tenant": "carol"})
    time.sleep(1.1)  # the mtime must change; the table looks at most once a second
    server.keys_file.write_text(json.dumps(doc))
    deadline = time.monotonic() + 5
    while True:
        try:
            list(server.stub.Generate(greedy_request([1, 2], 2), timeout=10, metadata=md(new)))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.3)


def _post(server, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v1/completions", data=body,
                                 headers={"Authorization": f"Bearer {BOB}", "Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    (b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
    (b'{"prompt": "hi", "temperature": ' + b"1" * 5000 + b"}", "temperature"),
    (b'{"prompt": "hi", "stop": ' + b"[" * 50 + b"]" * 50 + b"}", "stop"),
    (b'{"prompt": "hi", "user": ' + b"[" * 100000 + b"]" * 100000 + b"}", None),
    (b'{"prompt": "hi", "cache_salt": 5}', "cache_salt"),
    (b'{"prompt": "hi", "priority": 99}', "priority"),
])
def test_malformed_json_is_a_400_naming_the_field(server, body, param):
    status, out = _post(server, body)
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_an_oversized_body_is_refused_before_it_is_read(server):
    s = socket.create_connection(("127.0.0.1", server.server.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + BOB.encode()
              + b"\r\nContent-Length: 2147483648\r\n\r\n" + b"x" * 1000)
    s.settimeout(5)
    assert b" 413 " in s.recv(200)
    s.close()
    # and one with no length that streams past the cap
    s = socket.create_connection(("127.0.0.1", server.server.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + BOB.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * (1 << 20)
    s.settimeout(10)
    reply = b""
    try:
        for _ in range(8):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        reply = s.recv(200)
    except ConnectionResetError:
        reply = b"(reset)"
    assert b" 413 " in reply or reply == b"(reset)", reply
    s.close()


def test_slow_headers_are_cut_off_and_the_server_stays_up(server):
    conns = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", server.server.http_port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        conns.append(s)
    time.sleep(2.5)  # the header timeout is 1 s here
    for s in conns:
        s.settimeout(2)
        assert s.recv(100) == b"", "a connection without a whole request head is closed"
        s.close()
    status, out = _post(server, json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    assert status == 200, out


def test_one_address_holds_at_most_its_cap_of_http_connections_and_another_is_served(server):
    def health(conn: http.client.HTTPConnection) -> int:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r.status

    # (no WebSocket protocol: an upgraded connection would leave the per-address count behind)
    assert server.server.http.server.config.ws_protocol_class is None
    port = server.server.http_port
    # the kernel queues 2,048 connections (somaxconn permitting) though the door accepts 128 per wake-up
    listen = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True)
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(listen.stdout.split()[2]) == min(2048, somaxconn), listen.stdout
    held = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(PER_CLIENT)]
    assert {health(c) for c in held} == {200}  # (each stays open, idle in keep-alive)
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(5)
    with pytest.raises(ConnectionResetError):  # one past the cap: reset as it opens, nothing parsed
        extra.recv(100)
    extra.close()
    # another address (loopback is all of 127/8) is not held back by this one's connections
    other = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=("127.0.0.2", 0))
    assert health(other) == 200
    assert health(held[0]) == 200  # and the held ones still serve
    for c in [*held, other]:
        c.close()
    deadline = time.monotonic() + 10
    while True:  # once they are closed, the address may open connections again
        try:
            assert health(http.client.HTTPConnection("127.0.0.1", port, timeout=10)) == 200
            break
        except ConnectionResetError:
            assert time.monotonic() < deadline, "the address's count never came down"
            time.sleep(0.1)


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    # a prompt of 30k characters (past the door's off-loop threshold; the context admits 32 per token before
    # tokenizing) beside a running stream: tokenized on a thread, refused as too long, the stream unharmed
    got, gaps = [], []

    def stream():
        last = time.monotonic()
        for res in server.stub.Generate(greedy_request(PROMPT[:20], 300, ignore_eos=True), timeout=60,
                                        metadata=md(BOB)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            got.extend(res.token_ids)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)
    status, out = _post(server, json.dumps({"prompt": "word " * 6000, "max_tokens": 2}).encode())
    t.join(60)
    assert status == 400 and out["error"]["param"] == "prompt"  # too long for the context, after tokenizing
    assert len(got) == 300
