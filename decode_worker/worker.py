"""DecodeWorker: receives prompts' KV from the prefill pool and decodes them with continuous batching.

A Ray actor holding one model replica. For a disaggregated request the router calls `reserve` (blocks for
the prompt, reusing this worker's own prefix cache, and a KV receiver armed for them), then — once the
prefill worker has answered with the first token — `start`. The sequence joins the running batch when
both its KV has landed and its first token is known. Every engine step sends **one** message to the router
(`stream_steps`) carrying the new tokens of every running sequence (one each, or with speculative
decoding on, the verified drafts plus one).

A reservation is a lease: it lapses `lease_s` after it was made or last renewed (`renew`), and the router
renews it while the prompt's prefill worker is alive and making progress. So a prompt may wait in a prefill
queue or compute for minutes without losing its blocks, and blocks whose router or prefill worker went
away are freed within one lease.

With no KV transport (`kind="colocated"`), the same actor is the colocated baseline: `submit` queues a raw
prompt and the engine prefills and decodes it itself, streaming through the same `stream_steps`.

Every request id here is the router's attempt key: unique per attempt, never reused.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.messages import (
    Heartbeat,
    LoadReport,
    Reservation,
    StepOutput,
    TokenDelta,
    WorkerInfo,
    node_identity,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer import KVTransferConfig, create_receiver

# a reservation lapses this long after it was made or last renewed (the router renews it every ~0.5 s)
DEFAULT_LEASE_S = 30.0


@dataclass
class _Pending:
    """A reserved request whose KV or first token has not arrived yet."""

    request: Request
    lease_until: float  # time.monotonic(); renewed by the router while the prefill makes progress
    landed: bool = False
    first_token: int | None = None


class DecodeWorker:
    def __init__(self, worker_id: str, config: EngineConfig, kv_config: KVTransferConfig | None,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.worker_id = worker_id
        self.kind = "decode" if kv_config is not None else "colocated"
        self.lease_s = lease_s
        self.engine = LLMEngine(config)
        self.node_id, self.node_ip = node_identity()
        self.receiver = (create_receiver(kv_config, worker_id, self.engine.kv_cache, self.node_ip)
                         if kv_config is not None else None)
        self.pending: dict[str, _Pending] = {}
        self._outbox: asyncio.Queue[StepOutput] | None = None
        self._outbox_loop: asyncio.AbstractEventLoop | None = None
        # NOTE: steps produced before the router subscribes (a request can reach a fresh worker first)
        # wait here instead of being dropped: a dropped step is a missing token
        self._outbox_lock = threading.Lock()
        self._early: list[StepOutput] = []
        self.loop = EngineLoop(self.engine, self._on_step, poll=self._poll, on_fail=self._fail_transfers,
                               name=f"{worker_id}-loop")
        self.loop.start()

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.kind, self.node_id, self.node_ip,
                          self.engine.cache_spec.block_size, self.engine.allocator.num_blocks,
                          self.receiver.address if self.receiver else None, os.getpid())

    async def ping(self) -> Heartbeat:
        return Heartbeat(self.worker_id, time.monotonic() - self.loop.last_progress, self.loop.busy,
                         self.loop.alive)

    async def report(self) -> LoadReport:
        return await asyncio.wrap_future(self.loop.call(self._report))

    async def stream_steps(self) -> AsyncIterator[StepOutput]:
        """One message per engine step, forever (the router holds one such stream per worker)."""
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._outbox_lock:
            self._outbox_loop, self._outbox = asyncio.get_running_loop(), queue
            early, self._early = self._early, []
        for out in early:
            yield out
        while True:
            yield await queue.get()

    # -- disaggregated ----------------------------------------------------------------------------------

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      src: str) -> Reservation | None:
        """Blocks for the prompt and a receiver armed for sender `src`; None when out of room."""
        assert self.receiver is not None, "reserve() on a colocated worker"

        def reserve() -> Reservation | None:
            if request_id in self.engine.scheduler.requests:
                raise ValueError(f"request {request_id!r} is already reserved on {self.worker_id}")
            req = self._request(request_id, prompt_token_ids, params)
            blocks = self.engine.scheduler.reserve_for_kv(req)
            if blocks is None:
                return None
            skip = req.num_cached_tokens // self.engine.cache_spec.block_size
            until = time.monotonic() + self.lease_s
            if skip < len(blocks):
                try:
                    self.receiver.expect(request_id, src, blocks[skip:], until)
                except Exception:
                    self.engine.scheduler.finish(req, RequestStatus.FINISHED_ERROR)  # give the blocks back
                    raise
            self.pending[request_id] = _Pending(req, until, landed=skip >= len(blocks))
            return Reservation(self.receiver.address, list(blocks), skip, self.lease_s)

        return await asyncio.wrap_future(self.loop.call(reserve))

    async def renew(self, request_ids: list[str]) -> list[str]:
        """Extend the leases of these reservations by `lease_s`; returns the ids no longer reserved here."""
        until = time.monotonic() + self.lease_s
        # NOTE: answered on the actor thread, not the engine loop's: a renewal must not wait for a step
        # (a float store per entry; the loop thread only reads it)
        gone = []
        for rid in request_ids:
            pending = self.pending.get(rid)
            if pending is None:
                gone.append(rid)
                continue
            pending.lease_until = max(pending.lease_until, until)
            self.receiver.extend(rid, until)
        return gone

    async def start(self, request_id: str, first_token: int) -> bool:
        """The prefill worker sampled `first_token`: decode once the KV has landed. False if the
        reservation is gone (lapsed, failed): the router must place the request again."""

        def start() -> bool:
            pending = self.pending.get(request_id)
            if pending is None:
                return False
            pending.first_token = first_token
            self._admit_if_ready(pending)
            return True

        return await asyncio.wrap_future(self.loop.call(start))

    async def pause(self, request_ids: list[str]) -> None:
        """Backpressure: hold these sequences out of the batch (blocks kept) until `resume`."""
        await asyncio.wrap_future(self.loop.call(lambda: [self.engine.scheduler.pause(r) for r in request_ids]))

    async def resume(self, request_ids: list[str]) -> None:
        await asyncio.wrap_future(self.loop.call(lambda: [self.engine.scheduler.resume(r) for r in request_ids]))

    # -- colocated --------------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        await asyncio.wrap_future(self.loop.call(
            lambda: self.engine.scheduler.add(self._request(request_id, prompt_token_ids, params))))

    # -- both -------------------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Free whatever the request holds here; a no-op for unknown or finished requests."""

        def abort() -> None:
            # NOTE: the transfer is failed before the blocks are freed, so no late layer lands in them
            if self.pending.pop(request_id, None) is not None and self.receiver is not None:
                self.receiver.abort(request_id)
            self.engine.scheduler.abort(request_id)

        await asyncio.wrap_future(self.loop.call(abort))

    async def describe(self) -> dict:
        """What this worker holds right now (for debugging and operators)."""

        def describe() -> dict:
            return {"pending": {rid: {"landed": p.landed, "first_token": p.first_token,
                                      "transfer": self.receiver.poll(rid).name if not p.landed else None}
                                for rid, p in self.pending.items()},
                    "requests": {rid: r.status.name for rid, r in self.engine.scheduler.requests.items()},
                    "paused": sorted(self.engine.scheduler.paused)}

        return await asyncio.wrap_future(self.loop.call(describe))

    async def shutdown(self) -> None:
        self.loop.shutdown()
        if self.receiver is not None:
            self.receiver.close()

    # -- on the loop thread -----------------------------------------------------------------------------

    def _request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        return Request(request_id, prompt_token_ids, params, self.engine.cache_spec.block_size,
                       self.engine.eos_token_ids, self.engine.max_model_len)

    def _admit_if_ready(self, pending: _Pending) -> None:
        if not pending.landed or pending.first_token is None:
            return
        req = pending.request
        del self.pending[req.request_id]
        if self.engine.scheduler.kv_landed(req, pending.first_token):  # the first token already ends it
            self._emit([TokenDelta(req.request_id, [], req.finish_reason.value, req.num_cached_tokens)])

    def _fail_transfers(self, requests: list[Request]) -> None:
        """A failed step ends these requests: fail their transfers before their blocks are freed."""
        for r in requests:
            if self.pending.pop(r.request_id, None) is not None and self.receiver is not None:
                self.receiver.abort(r.request_id, "the decode worker's engine step failed")

    def _poll(self) -> bool:
        if self.receiver is None:
            return False
        failed = []
        now = time.monotonic()
        for rid, pending in list(self.pending.items()):
            # a lapsed lease whose transfer the receiver does not watch (every block was cached here, or the
            # KV landed and `start` never came): nobody will claim these blocks
            if pending.first_token is None and pending.lease_until < now and pending.landed:
                del self.pending[rid]
                self.engine.scheduler.finish(pending.request, RequestStatus.FINISHED_ERROR)
                failed.append(TokenDelta(rid, [], "error", error="the reservation's lease lapsed"))
        for result in self.receiver.pop_finished():
            pending = self.pending.get(result.request_id)
            if pending is None:
                continue
            if result.ok:
                pending.landed = True
                self._admit_if_ready(pending)
            else:
                del self.pending[result.request_id]
                self.engine.scheduler.finish(pending.request, RequestStatus.FINISHED_ERROR)
                failed.append(TokenDelta(result.request_id, [], "error", error=result.error))
        if failed:
            self._emit(failed)
        return bool(self.pending)

    def _on_step(self, out: StepOutput) -> None:
        with self._outbox_lock:
            if self._outbox is None:
                self._early.append(out)
                return
            loop, queue = self._outbox_loop, self._outbox
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        self._on_step(StepOutput(0, time.time(), deltas, self.engine.load()))

    def _report(self) -> LoadReport:
        events = self.engine.allocator.drain_events()
        return LoadReport(self.worker_id, self.engine.load(), events.stored, events.removed)
