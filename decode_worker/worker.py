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

Draining (`hold`, `send_kv`): a running sequence can leave this worker with its KV. `hold` takes it out of
the batch (its blocks kept, no further token) and says how many tokens it has produced; the router reserves
blocks for prompt + all but the last of them on another decode worker, and `send_kv` pushes the sequence's
KV there over the same transport a prefill worker uses. The destination then decodes on from the last
token, as if a prefill worker had sent it: nothing is recomputed. The router frees the source with `abort`.

Every request id here is the router's attempt key: unique per attempt, never reused.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, cdiv
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer import KVTransferConfig, TransferResult, create_receiver, create_sender
from protocol.kinds import FinishReason, PoolKind
from protocol.messages import (
    EngineLoad,
    Heartbeat,
    KVMoveResult,
    LoadReport,
    Reservation,
    StepOutput,
    TokenDelta,
    WorkerInfo,
    owner_of,
)
from protocol.node import node_identity

# a reservation lapses this long after it was made or last renewed (the router renews it every ~0.5 s)
DEFAULT_LEASE_S = 30.0
# a drained sequence's KV must have reached the other decode worker this long after the move began
KV_MOVE_TIMEOUT_S = 30.0
# steps kept for a router replica that has not subscribed yet (a fresh worker reached first): beyond this the
# replica is not coming (it died before subscribing), and its sequences are freed by `release_router`
MAX_EARLY_STEPS = 4096


@dataclass
class _Pending:
    """A reserved request whose KV or first token has not arrived yet."""

    request: Request
    lease_until: float  # time.monotonic(); renewed by the router while the prefill makes progress
    landed: bool = False
    first_token: int | None = None


@dataclass
class _Move:
    """A held sequence's KV on its way to another decode worker (keyed by the destination's attempt key)."""

    src: str  # the held sequence's attempt key here
    future: asyncio.Future
    opened_at: float
    num_bytes: int


class DecodeWorker:
    def __init__(self, worker_id: str, config: EngineConfig, kv_config: KVTransferConfig | None,
                 lease_s: float = DEFAULT_LEASE_S) -> None:
        self.worker_id = worker_id
        self.kind = PoolKind.DECODE if kv_config is not None else PoolKind.COLOCATED
        self.lease_s = lease_s
        self.engine = LLMEngine(config)
        self.node_id, self.node_ip = node_identity()
        self.receiver = (create_receiver(kv_config, worker_id, self.engine.kv_cache, self.node_ip)
                         if kv_config is not None else None)
        # a decode worker sends too: a drained sequence's KV to another decode worker
        self.sender = (create_sender(kv_config, worker_id, self.engine.kv_cache, self.node_ip)
                       if kv_config is not None else None)
        self.pending: dict[str, _Pending] = {}
        self.held: set[str] = set()  # sequences held for a move: backpressure's resume leaves them paused
        self.moves: dict[str, _Move] = {}  # by the destination's attempt key
        # each router replica's step stream, by its id ("" for a lone router): (its loop, its queue)
        self._outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepOutput]]] = {}
        # NOTE: steps produced before their router subscribes (a request can reach a fresh worker first)
        # wait here instead of being dropped: a dropped step is a missing token
        self._outbox_lock = threading.Lock()
        self._early: dict[str, list[StepOutput]] = {}
        self._released: set[str] = set()  # router replicas gone: their late tokens go nowhere
        self.loop = EngineLoop(self.engine, self._on_step, poll=self._poll, on_fail=self._fail_transfers,
                               name=f"{worker_id}-loop")
        self.loop.start()

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.kind, self.node_id, self.node_ip,
                          self.engine.cache_spec.block_size, self.engine.allocator.num_blocks,
                          self.receiver.address if self.receiver else None, os.getpid(),
                          self.engine.cache_spec.bytes_per_block // self.engine.cache_spec.block_size)

    async def ping(self) -> Heartbeat:
        return Heartbeat(self.worker_id, time.monotonic() - self.loop.last_progress, self.loop.busy,
                         self.loop.alive)

    async def report(self, since: int = -1) -> LoadReport:
        """Load, and the prefix-cache changes after change number `since` (see `CacheEventLog`)."""
        return await asyncio.wrap_future(self.loop.call(lambda: self.engine.load_report(self.worker_id, since)))

    async def stream_steps(self, router_id: str = "") -> AsyncIterator[StepOutput]:
        """One message per engine step, forever, carrying the tokens of the attempts router replica
        `router_id` owns (`owner_of` their keys) and the load. Each replica holds one such stream per worker;
        subscribing again replaces the replica's previous stream."""
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._outbox_lock:
            if router_id in self._released:
                return  # a replica declared gone: a late subscription of its must not take steps again
            self._outboxes[router_id] = (asyncio.get_running_loop(), queue)
            early = self._early.pop(router_id, [])
        try:
            for out in early:
                yield out
            while True:
                yield await queue.get()
        finally:
            with self._outbox_lock:
                if self._outboxes.get(router_id, (None, None))[1] is queue:
                    del self._outboxes[router_id]

    async def release_router(self, router_id: str, final: bool = True) -> int:
        """Free everything router replica `router_id`'s attempts hold here. `final`: the replica is gone (its
        clients' connections went with it): its steps go nowhere from now on; otherwise it lost its step
        stream and subscribes again. Returns how many attempts were freed."""

        def release() -> int:
            with self._outbox_lock:
                self._outboxes.pop(router_id, None)
                self._early.pop(router_id, None)
                if final:
                    self._released.add(router_id)
            keys = {k for k in (*self.pending, *self.engine.scheduler.requests) if owner_of(k) == router_id}
            for key in keys:
                self._abort(key)
            return len(keys)

        return await asyncio.wrap_future(self.loop.call(release))

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
                # NOTE: admitted already (its first token came before its KV finished landing): not lapsed
                if rid not in self.engine.scheduler.requests:
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
        await asyncio.wrap_future(self.loop.call(
            lambda: [self.engine.scheduler.resume(r) for r in request_ids if r not in self.held]))

    # -- draining: a running sequence leaves with its KV --------------------------------------------------

    async def hold(self, request_id: str) -> int | None:
        """Take a decoding sequence out of the batch for good (its blocks kept) and return how many tokens
        it has produced here; its KV then covers every token but the last. None when it is not decoding
        (finished, aborted, preempted for recompute, or still waiting for its KV)."""

        def hold() -> int | None:
            sched = self.engine.scheduler
            req = sched.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                return None
            if request_id not in sched.paused and not sched.pause(request_id):
                return None  # preempted: its KV is gone, only recompute can move it
            self.held.add(request_id)
            assert req.num_computed_tokens == req.num_tokens - 1, "a held sequence's KV is one token behind"
            return len(req.output_token_ids)

        return await asyncio.wrap_future(self.loop.call(hold))

    async def connect(self, peers: list) -> None:
        """Open KV links to these decode workers' receivers (`kv_transfer.PeerAddress`) ahead of moves."""
        assert self.sender is not None, "connect() on a colocated worker"
        for peer in peers:
            self.sender.connect(peer)

    async def send_kv(self, request_id: str, dst_key: str, reservation: Reservation) -> KVMoveResult:
        """Push held `request_id`'s KV into `reservation` (made on another decode worker for `dst_key`, with
        this worker named as the source); answers once the destination acknowledged every layer or the
        transfer failed. The held sequence stays here until the router aborts it."""
        assert self.sender is not None, "send_kv() on a colocated worker"
        future = asyncio.get_running_loop().create_future()

        def begin() -> None:
            req = self.engine.scheduler.requests.get(request_id)
            if req is None or request_id not in self.held:
                raise ValueError(f"request {request_id!r} is not held on {self.worker_id}; call hold() first")
            bs = self.engine.cache_spec.block_size
            n, skip = cdiv(req.num_computed_tokens, bs), reservation.num_cached_blocks
            if len(reservation.block_ids) != n:
                raise ValueError(f"reservation: {len(reservation.block_ids)} blocks for a sequence whose KV "
                                 f"fills {n} (of {bs} tokens) on {self.worker_id}")
            if skip >= n:  # the destination caches all of it already
                future.set_result(KVMoveResult(True))
                return
            self.sender.begin(dst_key, reservation.kv_address, req.block_ids[skip:n], reservation.block_ids[skip:n],
                              time.monotonic() + KV_MOVE_TIMEOUT_S)
            for layer in range(self.engine.cache_spec.num_layers):  # all written long ago: ship them all
                self.sender.send_layer(dst_key, layer)
            self.moves[dst_key] = _Move(request_id, future, time.time(), (n - skip) * self.engine.cache_spec.bytes_per_block)

        await asyncio.wrap_future(self.loop.call(begin))
        return await future

    async def kv_digest(self, request_id: str, num_tokens: int) -> str:
        """SHA-256 of the K and V of the sequence's first `num_tokens` positions, every layer: what a moved
        sequence's source and destination must agree on bit for bit (`--verify-kv-moves`)."""

        def digest() -> str:
            sched = self.engine.scheduler
            req = sched.requests.get(request_id) or sched.paused.get(request_id)
            if req is None or req.num_computed_tokens < num_tokens:
                raise ValueError(f"request {request_id!r} holds no KV for {num_tokens} tokens on {self.worker_id}")
            bs = self.engine.cache_spec.block_size
            blocks = req.block_ids[:cdiv(num_tokens, bs)]
            # [num_layers, 2, n_blocks * block_size, kv_heads, head_dim], cut to the sequence's positions
            kv = self.engine.kv_cache.tensor[:, :, blocks].flatten(2, 3)[:, :, :num_tokens]
            return hashlib.sha256(kv.contiguous().cpu().view(-1).view(torch.uint8).numpy()).hexdigest()

        return await asyncio.wrap_future(self.loop.call(digest))

    # -- colocated --------------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        await asyncio.wrap_future(self.loop.call(
            lambda: self.engine.scheduler.add(self._request(request_id, prompt_token_ids, params))))

    # -- both -------------------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Free whatever the request holds here; a no-op for unknown or finished requests."""

        await asyncio.wrap_future(self.loop.call(lambda: self._abort(request_id)))

    async def describe(self) -> dict:
        """What this worker holds right now (for debugging and operators)."""

        def describe() -> dict:
            return {"pending": {rid: {"landed": p.landed, "first_token": p.first_token,
                                      "transfer": self.receiver.poll(rid).name if not p.landed else None}
                                for rid, p in self.pending.items()},
                    "requests": {rid: r.status.name for rid, r in self.engine.scheduler.requests.items()},
                    "paused": sorted(self.engine.scheduler.paused), "held": sorted(self.held),
                    "moves": sorted(self.moves)}

        return await asyncio.wrap_future(self.loop.call(describe))

    async def shutdown(self) -> EngineLoad:
        """Stop; returns the load it stopped with (a drained worker's shows it held nothing)."""
        load = await asyncio.wrap_future(self.loop.call(self.engine.load))
        self.loop.shutdown()
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()
        return load

    # -- on the loop thread -----------------------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        # NOTE: the transfer is failed before the blocks are freed, so no late layer lands in them
        if self.pending.pop(request_id, None) is not None and self.receiver is not None:
            self.receiver.abort(request_id)
        if request_id in self.held:  # a move still reading its blocks ends before they are freed
            self.held.discard(request_id)
            for dst_key in [k for k, m in self.moves.items() if m.src == request_id]:
                self.sender.abort(dst_key, "the moved sequence was aborted at its source")
        self.engine.scheduler.abort(request_id)

    def _request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        return Request(request_id, prompt_token_ids, params, self.engine.cache_spec.block_size,
                       self.engine.eos_token_ids, self.engine.max_model_len)

    def _admit_if_ready(self, pending: _Pending) -> None:
        if not pending.landed or pending.first_token is None:
            return
        req = pending.request
        del self.pending[req.request_id]
        if self.engine.scheduler.kv_landed(req, pending.first_token):  # the first token already ends it
            self._emit([TokenDelta(req.request_id, [], req.finish_reason, req.num_cached_tokens)])

    def _fail_transfers(self, requests: list[Request]) -> None:
        """A failed step ends these requests: fail their transfers before their blocks are freed."""
        for r in requests:
            if self.pending.pop(r.request_id, None) is not None and self.receiver is not None:
                self.receiver.abort(r.request_id, "the decode worker's engine step failed")

    def _poll(self) -> bool:
        if self.receiver is None:
            return False
        for result in self.sender.pop_finished():
            self._moved(result)
        failed = []
        now = time.monotonic()
        for rid, pending in list(self.pending.items()):
            # a lapsed lease whose transfer the receiver does not watch (every block was cached here, or the
            # KV landed and `start` never came): nobody will claim these blocks
            if pending.first_token is None and pending.lease_until < now and pending.landed:
                del self.pending[rid]
                self.engine.scheduler.finish(pending.request, RequestStatus.FINISHED_ERROR)
                failed.append(TokenDelta(rid, [], FinishReason.ERROR, error="the reservation's lease lapsed"))
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
                failed.append(TokenDelta(result.request_id, [], FinishReason.ERROR, error=result.error))
        if failed:
            self._emit(failed)
        return bool(self.pending or self.moves)

    def _moved(self, result: TransferResult) -> None:
        move = self.moves.pop(result.request_id, None)
        if move is None:
            return
        outcome = KVMoveResult(result.ok, move.num_bytes if result.ok else 0, time.time() - move.opened_at,
                               None if result.ok else f"KV move failed: {result.error}")
        move.future.get_loop().call_soon_threadsafe(
            lambda: move.future.done() or move.future.set_result(outcome))

    def _on_step(self, out: StepOutput) -> None:
        """Send the step to the router replicas: each gets its own attempts' tokens, and every one the load."""
        with self._outbox_lock:
            outboxes = dict(self._outboxes)
        if len(outboxes) == 1 and not self._early:  # the usual case, one router: the step as it is
            (owner, (loop, queue)), = outboxes.items()
            if all(owner_of(d.request_id) == owner for d in out.deltas):
                loop.call_soon_threadsafe(queue.put_nowait, out)
                return
        by_owner: dict[str, list[TokenDelta]] = {owner: [] for owner in outboxes}
        for d in out.deltas:
            by_owner.setdefault(owner_of(d.request_id), []).append(d)
        with self._outbox_lock:
            for owner, deltas in by_owner.items():
                part = StepOutput(out.step, out.time, deltas, out.load, out.stats)
                if owner in self._outboxes:
                    loop, queue = self._outboxes[owner]
                    loop.call_soon_threadsafe(queue.put_nowait, part)
                elif deltas and owner not in self._released:  # not subscribed yet: kept for its stream
                    early = self._early.setdefault(owner, [])
                    if len(early) < MAX_EARLY_STEPS:
                        early.append(part)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        self._on_step(StepOutput(None, time.time(), deltas, self.engine.load()))


