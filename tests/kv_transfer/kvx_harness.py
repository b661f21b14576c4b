"""Test harness: a worker-like peer that hosts KV senders and receivers in its own process.

A `Peer` behaves like the two workers do: it reserves blocks from a real BlockAllocator, `expect`s them,
pushes layers from a "model" thread, and runs a step loop that collects finished transfers and frees blocks
(the receiver's on failure only, the sender's always). It hosts any number of endpoints (one per key, each
with its own cache, allocator and transport config). The same class runs in a spawned process
(`ProcessPeer`) or as a Ray actor (`RayPeer`); both offer `call(method, *args)`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVReceiver, KVSender, KVTransferConfig, create_receiver, create_sender
from kv_transfer.layout import DTYPES
from protocol.messages import PeerAddress

HOST = "127.0.0.1"  # tests only: workers pass their node IP
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENTINEL = 7  # byte value of blocks the receiver "already holds in its prefix cache"


SECRET = "test-deployment-secret"


def make_config(transport: str, port: int | None, secret: str | None = SECRET) -> KVTransferConfig:
    """Timeouts short enough that failure tests finish in seconds, long enough for a loaded 2-core box.
    Link requests are authenticated, as in a deployment, unless `secret` is None.

    NOTE: the Ray object-store transport gets more: each of its messages is an actor call, and on a slow
    day of this machine a first call to a fresh inbox, or a long-poll under ten interleaved transfers,
    took over 2 s, and in a clean-clone CI run (2026-12-02) one inbox call of a warm-up transfer took over
    6 s while the suite's other Ray workers ran, and in another a receiver's reply took over 6 s to come
    back. Its `op_timeout_s` (one actor call) is 15 s: no failure test waits for it to pass (a killed
    inbox fails its calls at once, a paused peer's inbox is not paused), so a generous bound costs
    nothing; its `liveness_s` (the silence after which a pair is dead) is 12 s, which the tests that
    pause a peer wait through."""
    liveness_s = 12.0 if transport == "ray" else 2.0
    op_timeout_s = 15.0 if transport == "ray" else 2.0
    return KVTransferConfig(kv_transport=transport, rendezvous_host=HOST if transport == "torch" else None,
                            rendezvous_port=port if transport == "torch" else None, connect_timeout_s=20.0,
                            op_timeout_s=op_timeout_s, keepalive_s=0.25, liveness_s=liveness_s, secret=secret)


@dataclass(frozen=True)
class Spec:
    """A picklable KVCacheSpec."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    def kv(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, DTYPES[self.dtype])


class Outcome(NamedTuple):
    ok: bool
    error: str | None
    block_ids: tuple[int, ...]
    elapsed_s: float  # from reserve/push to the step loop seeing it finished


class Job(NamedTuple):
    """One request a sender pushes: dst blocks of which the first `skip` are already at the receiver."""

    request_id: str
    dst: PeerAddress
    dst_block_ids: list[int]
    skip: int = 0


@dataclass
class _Endpoint:
    cache: KVCache
    allocator: BlockAllocator
    transport: KVSender | KVReceiver
    started: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    held: dict[str, list[int]] = field(default_factory=dict)
    sent: dict[str, torch.Tensor] = field(default_factory=dict)


class Peer:
    def __init__(self, name: str, host: str = HOST) -> None:
        self.name, self.host = name, host
        self._rng = random.Random(name)
        self._gen = torch.Generator().manual_seed(self._rng.randrange(2**31))
        self._eps: dict[str, _Endpoint] = {}
        self._cv = threading.Condition()
        self._stop = False
        threading.Thread(target=self._step_loop, daemon=True).start()

    def pid(self) -> int:
        return os.getpid()

    def endpoint_id(self, key: str) -> str:
        return f"{self.name}/{key}"

    def open_receiver(self, key: str, spec: Spec, num_blocks: int, config: KVTransferConfig,
                      device: str = "cpu") -> PeerAddress:
        ep = self._open(key, spec, num_blocks, config, device, receiver=True)
        assert isinstance(ep.transport, KVReceiver)
        return ep.transport.address

    def open_sender(self, key: str, spec: Spec, num_blocks: int, config: KVTransferConfig,
                    device: str = "cpu") -> str:
        self._open(key, spec, num_blocks, config, device, receiver=False)
        return self.endpoint_id(key)

    def reserve(self, key: str, request_id: str, n: int, skip: int, src: str, timeout_s: float) -> list[int]:
        """Decode side: reserve `n` blocks; the first `skip` stand for prefix-cache hits (kept at SENTINEL)."""
        with self._cv:
            ep = self._eps[key]
            ids = ep.allocator.allocate(n)
            assert ids is not None, f"{self.name}: no room for {n} blocks"
            if skip:
                ep.cache.tensor[:, :, ids[:skip]] = _bytes_as(ep.cache.tensor, skip, torch.full, SENTINEL)
            ep.held[request_id] = ids
            ep.started[request_id] = time.monotonic()
            assert isinstance(ep.transport, KVReceiver)
            ep.transport.expect(request_id, src, ids[skip:], time.monotonic() + timeout_s)
        return ids

    def push(self, key: str, jobs: list[Job], timeout_s: float, layer_delay_s: float = 0.0,
             stop_after: int | None = None) -> None:
        """Prefill side: fill fresh blocks with random bytes, begin every job, then a "model" thread calls
        send_layer layer by layer, interleaving the jobs (and stopping before layer `stop_after`)."""
        with self._cv:
            ep = self._eps[key]
            sender = ep.transport
            assert isinstance(sender, KVSender)
            for job in jobs:
                src = ep.allocator.allocate(len(job.dst_block_ids))
                assert src is not None, f"{self.name}: no room for {len(job.dst_block_ids)} blocks"
                t = ep.cache.tensor
                # random bytes, not random numbers: every bit pattern (NaN payloads too) must survive the trip
                t[:, :, src] = _bytes_as(t, len(src), lambda shape, **kw: torch.randint(0, 256, shape, **kw),
                                         generator=self._gen)
                ep.sent[job.request_id] = t[:, :, src].cpu().clone()
                ep.started[job.request_id] = time.monotonic()
                sender.begin(job.request_id, job.dst, src[job.skip:], job.dst_block_ids[job.skip:],
                             time.monotonic() + timeout_s)
                ep.held[job.request_id] = src

        def model() -> None:
            for layer in range(ep.cache.spec.num_layers):
                if stop_after is not None and layer >= stop_after:
                    return
                for job in jobs:
                    sender.send_layer(job.request_id, layer)
                if layer_delay_s:
                    time.sleep(layer_delay_s)

        threading.Thread(target=model, daemon=True).start()

    def status(self, key: str, request_id: str) -> str:
        try:
            return self._eps[key].transport.poll(request_id).name
        except KeyError:
            return "COLLECTED"

    def sent(self, key: str, request_id: str) -> torch.Tensor:
        """[num_layers, 2, n, block_size, num_kv_heads, head_dim]: what the sender's blocks held, as bytes
        (the caller compares bytes; and Ray cannot pickle a float8 tensor)."""
        return self._eps[key].sent[request_id].view(torch.uint8)

    def blocks(self, key: str, block_ids: list[int]) -> torch.Tensor:
        """What the cache's `block_ids` hold, as bytes, in the same shape."""
        return self._eps[key].cache.tensor[:, :, block_ids].cpu().clone().view(torch.uint8)

    def outcome(self, key: str, request_id: str, timeout_s: float) -> Outcome:
        with self._cv:
            ep = self._eps[key]
            if not self._cv.wait_for(lambda: request_id in ep.outcomes, timeout_s):
                raise TimeoutError(f"{self.name}/{key}: {request_id!r} unfinished after {timeout_s}s")
            return ep.outcomes[request_id]

    def release(self, key: str, request_id: str) -> None:
        """Decode side, after the test has read a landed transfer: the sequence finished."""
        with self._cv:
            ep = self._eps[key]
            ep.allocator.free(ep.held.pop(request_id))

    def num_free(self, key: str) -> int:
        with self._cv:
            ep = self._eps[key]
            ep.allocator.check_invariants()
            return ep.allocator.num_free_blocks

    def close(self) -> None:
        with self._cv:
            self._stop = True
            eps = list(self._eps.values())
        for ep in eps:
            ep.transport.close()

    def _open(self, key: str, spec: Spec, num_blocks: int, config: KVTransferConfig, device: str,
              receiver: bool) -> _Endpoint:
        cache = KVCache(spec.kv(), num_blocks, device)
        allocator = BlockAllocator(num_blocks, enable_caching=False)
        ids = allocator.allocate(num_blocks)  # shuffle the free queue: reserved ids come out scattered
        assert ids is not None
        self._rng.shuffle(ids)
        allocator.free(ids)
        make = create_receiver if receiver else create_sender
        ep = _Endpoint(cache, allocator, make(config, self.endpoint_id(key), cache, self.host))
        with self._cv:
            self._eps[key] = ep
        return ep

    def _step_loop(self) -> None:
        """What a worker's step loop does with finished transfers."""
        while True:
            with self._cv:
                if self._stop:
                    return
                for ep in self._eps.values():
                    for r in ep.transport.pop_finished():
                        ep.outcomes[r.request_id] = Outcome(r.ok, r.error, r.block_ids,
                                                            time.monotonic() - ep.started[r.request_id])
                        if isinstance(ep.transport, KVSender) or not r.ok:
                            ep.allocator.free(ep.held.pop(r.request_id))
                self._cv.notify_all()
                self._cv.wait(0.005)


def _bytes_as(cache: torch.Tensor, n: int, make: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`make(shape, *args, dtype=uint8)` bytes for `n` blocks of `cache`, viewed as its dtype and device:
    [num_layers, 2, n, block_size, num_kv_heads, head_dim]."""
    shape = (cache.shape[0], 2, n, *cache.shape[3:-1], cache.shape[-1] * cache.element_size())
    return make(shape, *args, dtype=torch.uint8, **kwargs).view(cache.dtype).to(cache.device)


def _serve(conn: Any, name: str) -> None:
    peer = Peer(name)
    conn.send((True, None))
    while True:
        method, args = conn.recv()
        try:
            conn.send((True, getattr(peer, method)(*args)))
        except Exception as e:  # the test process sees it as the call's error
            conn.send((False, f"{type(e).__name__}: {e}"))


class ProcessPeer:
    """A Peer in a spawned process (torch.multiprocessing's spawn start method)."""

    kind = "mp"

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, name), daemon=True, name=f"peer-{name}")
        self.proc.start()
        self._ready = False

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        if not self._ready:
            self._recv(timeout)
            self._ready = True
        self._conn.send((method, args))
        return self._recv(timeout)

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer within {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"peer {self.name}: {value}")
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=15)
            finally:
                self.kill()


class RayPeer:
    """A Peer as a Ray actor (threaded, so `outcome` may wait while other calls run)."""

    kind = "ray"

    def __init__(self, name: str) -> None:
        import ray

        self.name = name
        env = {"PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests", "kv_transfer")]),
               "RAY_AUTH_MODE": "disabled"}
        self.actor = ray.remote(Peer).options(num_cpus=0, max_concurrency=4,
                                              runtime_env={"env_vars": env}).remote(name)

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def shutdown(self) -> None:
        import ray

        try:
            self.call("close", timeout=15)
        finally:
            ray.kill(self.actor, no_restart=True)
