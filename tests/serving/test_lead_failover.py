"""The lead router replica dies: `pdserve serve --routers 2` joined to a Ray cluster (the test session's), its
process SIGKILLed mid-stream.

- the other replica's stream finishes with the engine's tokens; the lead's ends;
- the other replica takes the pools over: after --worker-timeout it serves the Admin API, it declares a
  killed worker dead and starts its replacement, and it starts a router replica in the lead's place, which
  serves the port;
- `pdserve stop` then drains and stops the whole deployment, whichever replica leads it: no actor of it is
  left, and every CPU it held is back;
- a stalled (SIGSTOPped) lead is fenced: the replica taking over kills its process, whose socket would
  otherwise keep taking connections it never answers;
- `pdserve stop` right after a lead died (before any replica took over) still stops everything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from engine import LLM, SamplingParams
from protos.pdserve.v1 import admin_pb2 as admin
from protos.pdserve.v1 import admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import collect_stream, greedy_request, token_ids

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
TOKENS = 400
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 all free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _served(metrics_port: int) -> float:
    """pdserve_requests_total on one replica's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_requests_total{"))


def _pinned(address: str, metrics: int) -> dict[int, grpc.Channel]:
    """One connection to each replica (index 0 serves /metrics on `metrics`, 1 on `metrics` + 1)."""
    found: dict[int, grpc.Channel] = {}
    for _ in range(40):
        if len(found) == 2:
            return found
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        before = [_served(metrics), _served(metrics + 1)]
        list(pb_grpc.GenerationStub(channel).Generate(greedy_request([3, 4], 1), timeout=60))
        after = [_served(metrics), _served(metrics + 1)]
        [index] = [i for i in (0, 1) if after[i] != before[i]]
        if index in found:
            channel.close()
        else:
            found[index] = channel
    raise AssertionError(f"connections reached replicas {sorted(found)} only")


ACTORS = (b"ray::RouterReplica", b"ray::AdminMailbox", b"ray::RendezvousHost", b"ray::PrefillWorker",
          b"ray::DecodeWorker")


def _deployment_processes() -> set[int]:
    """Pids of every process on this machine that is one of a deployment's actors (by Ray's process title)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(ACTORS):
                        pids.add(int(entry))
            except OSError:
                pass
    return pids


def _workers(address: str) -> admin.ListWorkersResponse:
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).ListWorkers(admin.ListWorkersRequest(), timeout=30)


def _wait(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (grpc.RpcError, OSError):
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@contextlib.contextmanager
def deployment(ray):
    """`pdserve serve --routers 2` joined to the session's Ray cluster, as its own process; yields (process,
    gRPC address, metrics port of replica 0). Whatever happens, the deployment is stopped afterwards
    (`pdserve stop`, which the test may have run itself) and every CPU it held is back."""
    cpus = ray.available_resources().get("CPU", 0)
    _wait("an earlier deployment's actors to end", lambda: not _deployment_processes(), timeout=60)
    port, metrics = _free_ports(1), _free_ports(2)
    gcs = ray.get_runtime_context().gcs_address
    lead = subprocess.Popen(
        [sys.executable, "-m", "control.cli", "serve", "--model", MODEL, "--ray-address", gcs, "--port", str(port),
         "--metrics-port", str(metrics), "--routers", "2", "--http-port", "0", "--worker-threads", "1",
         "--num-blocks", "256", "--worker-timeout", "5"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=ENV)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(lead.stderr.readline, "")), daemon=True).start()
    try:
        _wait("the deployment to serve", lambda: lead.poll() is not None or any(
            "router replica 1 " in line and "serving" in line for line in log))
        assert lead.poll() is None, "".join(log[-40:])
        yield lead, f"127.0.0.1:{port}", metrics
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(lead.pid, signal.SIGCONT)
        done = stop(ray, port, grace=0)  # (a no-op answer when the test stopped it already)
        assert done.returncode == 0 or "no pdserve deployment" in done.stderr, done.stderr[-3000:]
        if lead.poll() is None:
            lead.kill()
        lead.wait(10)
        _wait("every CPU back", lambda: ray.available_resources().get("CPU", 0) == cpus, timeout=60)
        _wait("no actor of the deployment left", lambda: not _deployment_processes(), timeout=60)


def stop(ray, port: int, grace: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "control.cli", "stop", "--port", str(port), "--ray-address",
                           ray.get_runtime_context().gcs_address, "--grace", str(grace)],
                          capture_output=True, text=True, env=ENV, timeout=180)


def _stream_through_both(address: str, metrics: int, interrupt) -> dict[int, object]:
    """One long greedy stream through each replica; `interrupt()` once both are streaming."""
    channels = _pinned(address, metrics)
    results: dict[int, object] = {}
    streaming = threading.Barrier(3)

    def stream(index: int) -> None:
        results[index] = collect_stream(pb_grpc.GenerationStub(channels[index]),
                                        greedy_request(PROMPT, TOKENS, ignore_eos=True), streaming)

    threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    streaming.wait(120)
    interrupt()
    for t in threads:
        t.join(300)
    return results


def _serves_every_connection(address: str, reference: list[int], n: int = 4) -> None:
    for _ in range(n):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            got = token_ids(list(pb_grpc.GenerationStub(channel).Generate(
                greedy_request(PROMPT, 16, ignore_eos=True), timeout=60)))
            assert got == reference[:16]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return LLM(MODEL, num_blocks=64).generate(
        [PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))[0].token_ids


def test_the_other_replica_takes_the_pools_over_when_the_lead_dies(ray_cluster, reference):
    ray = ray_cluster
    with deployment(ray) as (lead, address, metrics):
        results = _stream_through_both(address, metrics, lambda: os.kill(lead.pid, signal.SIGKILL))
        assert results[1] == reference  # the surviving replica's stream is whole and exact
        assert isinstance(results[0], grpc.StatusCode), results[0]  # the lead's ended with its process

        # the survivor took the pools over: Admin answers (it runs the calls itself now) ...
        before = _wait("the Admin API after the lead's death", lambda: _workers(address))
        decode = next(w for w in before.workers if w.worker_id.startswith("decode"))
        # ... it declares a killed worker dead and replaces it (workers are detached: they outlived the lead)
        os.kill(decode.pid, signal.SIGKILL)
        after = _wait("the killed decode worker's replacement", lambda: (lambda r: r if any(
            w.worker_id.startswith("decode") and w.worker_id != decode.worker_id for w in r.workers)
            else None)(_workers(address)))
        assert decode.worker_id not in {w.worker_id for w in after.workers}
        # ... and a replica serves in the lead's place (its /metrics on the lead's port again), taking its
        # share of the new connections
        _wait("a replica in the lead's place", lambda: _served(metrics) >= 0)
        before = _served(metrics)
        _serves_every_connection(address, reference, n=12)
        assert _served(metrics) > before, "no connection reached the replica in the lead's place"

        # `pdserve stop`: the new lead drains and stops everything
        done = stop(ray, int(address.rsplit(":", 1)[1]), grace=5)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "stopped (its lead: router replica 1." in done.stderr, done.stderr[-3000:]
        with pytest.raises(ValueError):  # the mailbox is gone with the deployment
            ray.get_actor("routers-" + address.rsplit(":", 1)[1], namespace="pdserve")
        with pytest.raises(grpc.RpcError), grpc.insecure_channel(address) as channel:
            list(pb_grpc.GenerationStub(channel).Generate(greedy_request(PROMPT, 1), timeout=5))


def test_a_stalled_lead_is_fenced_and_replaced_and_a_stop_outlives_the_next_lead(ray_cluster, reference):
    """SIGSTOP the serve process: its socket keeps taking connections it will never answer. The replica
    that takes the pools over kills it (same node), so every new connection is served. Then that lead is
    killed and `pdserve stop` runs at once, before the last replica took over."""
    ray = ray_cluster
    with deployment(ray) as (lead, address, metrics):
        results = _stream_through_both(address, metrics, lambda: os.kill(lead.pid, signal.SIGSTOP))
        assert results[1] == reference
        # (fencing lets the stopped lead run for a second before the kill: its stream may end in it)
        assert isinstance(results[0], grpc.StatusCode) or results[0] == reference, results[0]
        # fenced by the new lead: woken, it learns at its next beat that it was deposed and exits (or is killed)
        assert lead.wait(60) in (0, -signal.SIGKILL)
        _wait("the Admin API after the takeover", lambda: _workers(address))
        _serves_every_connection(address, reference, n=6)

        # the new lead dies too, and `pdserve stop` comes before any replica took over: the replica that
        # claims the lead finds the request at its first beat and stops everything
        _wait("a replica in the lead's place", lambda: _served(metrics) >= 0)
        port = int(address.rsplit(":", 1)[1])
        mailbox = ray.get_actor(f"routers-{port}", namespace="pdserve")
        now = ray.get(mailbox.describe.remote(), timeout=30)
        assert now.lead.startswith("1.") and now.process.title == b"ray::RouterReplica"
        os.kill(now.process.pid, signal.SIGKILL)
        done = stop(ray, port, grace=0)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"its lead: router replica {now.lead})" in done.stderr, done.stderr[-3000:]
        _wait("no actor of the deployment left", lambda: not _deployment_processes(), timeout=60)
