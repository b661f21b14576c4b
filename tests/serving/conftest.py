"""A real pdserve deployment per test module: Ray actors, gloo KV transfer, a gRPC server on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from control.config import ServeConfig
from control.server import Server
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.security import ClientSecurity


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server in another process, which binds it itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A Server on its own event-loop thread, with a blocking client for tests."""

    def __init__(self, config: ServeConfig, client_key: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(config)
        self.run(self.server.start(), timeout=300)
        self.address = f"127.0.0.1:{self.server.port}"
        # every call carries the key, if there is one, as a client that set it once would send it
        self.channel = ClientSecurity(api_key=client_key).channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def reports(self):
        """Every live worker's load report, fresh from the worker."""
        import ray

        workers = [w for w in self.server.router.workers.values() if w.alive]
        return {w.worker_id: r for w, r in zip(workers, ray.get([w.client.actor.report.remote() for w in workers]))}

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Wait until no worker holds a block or runs a sequence; return the reports either way."""
        deadline = time.monotonic() + timeout
        while True:
            reports = self.reports()
            if all(r.load.free_blocks == r.load.total_blocks and r.load.num_running == 0
                   and r.load.num_waiting == 0 for r in reports.values()):
                return reports
            if time.monotonic() > deadline:
                return reports
            time.sleep(0.05)

    def generate(self, request: pb.GenerateRequest, timeout: float = 120) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(request, timeout=timeout))

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextmanager
def running_server(client_key: str | None = None, **kwargs) -> Iterator[RunningServer]:
    """A server from `ServeConfig(**kwargs)`; `client_key`: the key its test client sends on every call."""
    kwargs.setdefault("port", 0)
    kwargs.setdefault("worker_threads", 1)
    kwargs.setdefault("metrics_port", 0)
    kwargs.setdefault("http_port", 0)
    # NOTE: 512 blocks a worker (8,192 tokens), not a share of free memory (~1,450 here): a built-in worker
    # faults its whole cache in at start (engine.kv_cache.huge_page_zeros), 1.7-3.7 s per GB on this VM over
    # huge pages, and a suite starts over a hundred workers. Tests of the cache's own sizing pass theirs.
    builtin = "vllm" not in {kwargs.get(k) for k in ("engine", "prefill_engine", "decode_engine")}
    if builtin and "kv_cache_memory_bytes" not in kwargs:
        kwargs.setdefault("num_blocks", 512)
    server = RunningServer(ServeConfig(**kwargs), client_key)
    try:
        yield server
    finally:
        server.close()


def greedy_request(prompt: str | list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)
    return req


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def collect_stream(stub, request: pb.GenerateRequest, streaming: threading.Barrier) -> list[int] | grpc.StatusCode:
    """One stream's tokens, or the status it ended with; waits at `streaming` once three messages are in (so
    a test can interrupt several streams that are all under way)."""
    got: list[int] = []
    try:
        for k, res in enumerate(stub.Generate(request, timeout=300)):
            got += res.token_ids
            if k == 2:
                streaming.wait(60)
        return got
    except grpc.RpcError as e:
        return e.code()


@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    return ray_cluster
