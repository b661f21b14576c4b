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
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from decode_worker.step_fanout import StepFanout
from engine.backend import EngineBackend, create_engine
from engine.config import EngineConfig, cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.worker_base import Closable, WorkerBase
from kv_transfer import KVReceiver, KVSender, KVTransferConfig, TransferResult, create_receiver, create_sender
from protocol.kinds import FinishReason, PoolKind
from protocol.messages import (
    KVMoveResult,
    Reservation,
    RouterId,
    StepOutput,
    TokenDelta,
)

logger = logging.getLogger(__name__)

# a reservation lapses this long after it was made or last renewed (the router renews it every ~0.5 s)
DEFAULT_LEASE_S = 30.0
ADMITTED_MEMORY = 4096  # recently admitted ids `renew` remembers (more than a lease's worth at any rate here)


@dataclass
class _Pending:
    """A reserved request not decoding yet: its KV is landing (WAITING_FOR_KV) or landed (KV_LANDED), and its
    first token may not have come yet."""

    request: Request
    lease_until: float  # time.monotonic(); renewed by the router while the prefill makes progress
    first_token: int | None = None

    @property
    def landed(self) -> bool:
        return self.request.status is RequestStatus.KV_LANDED


@dataclass
class _Move:
    """A held sequence's KV on its way to another decode worker (keyed by the destination's attempt key)."""

    src: str  # the held sequence's attempt key here
    future: asyncio.Future
    opened_at: float
    num_bytes: int


class DecodeWorker(WorkerBase):
    def __init__(self, worker_id: str, config: EngineConfig, kv_config: KVTransferConfig | None,
                 lease_s: float = DEFAULT_LEASE_S, *, engine: EngineBackend | None = None,
                 receiver: KVReceiver | None = None, sender: KVSender | None = None) -> None:
        """`kv_config` None: the colocated role (no KV transport). `engine`, `receiver` and `sender`: made from
        `config` and `kv_config` unless passed in (tests pass their own)."""
        if engine is None:
            engine = create_engine(config)
        super().__init__(worker_id, engine)
        self.kind = PoolKind.DECODE if kv_config is not None else PoolKind.COLOCATED
        self.lease_s = lease_s
        if kv_config is not None:
            self.receiver = receiver if receiver is not None else create_receiver(
                kv_config, worker_id, engine.landing_cache, self.node_ip)
            # a decode worker sends too: a drained sequence's KV to another decode worker
            self.sender = sender if sender is not None else create_sender(
                kv_config, worker_id, engine.kv_cache, self.node_ip)
        else:
            self.receiver, self.sender = None, None
        self.pending: dict[str, _Pending] = {}
        # ids whose KV landed and decode began lately (bounded): `renew` must not call them lapsed when a
        # short request has finished before the router, busy, has seen its prefill end
        self.admitted: OrderedDict[str, None] = OrderedDict()
        self.held: set[str] = set()  # sequences held for a move: backpressure's resume leaves them paused
        self.moves: dict[str, _Move] = {}  # by the destination's attempt key
        self.steps = StepFanout()  # to each router replica, its attempts' tokens
        self._start_loop()

    async def stream_steps(self, router_id: RouterId = None) -> AsyncIterator[StepOutput]:
        """One message per engine step, forever, carrying the tokens of the attempts router replica
        `router_id` owns (`owner_of` their keys) and the load. Each replica holds one such stream per worker;
        subscribing again replaces the replica's previous stream."""
        async with aclosing(self.steps.subscribe(router_id)) as steps:  # (closed with this stream)
            async for out in steps:
                yield out

    # -- disaggregated ----------------------------------------------------------------------------------

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      src: str) -> Reservation | None:
        """Blocks for the prompt and a receiver armed for sender `src`; None when out of room."""
        assert self.receiver is not None, "reserve() on a colocated worker"

        def reserve() -> Reservation | None:
            if request_id in self.engine.requests:
                raise ValueError(f"request {request_id!r} is already reserved on {self.worker_id}")
            req = self.engine.make_request(request_id, prompt_token_ids, params)
            blocks = self.engine.reserve_for_kv(req)
            if blocks is None:
                return None
            skip = req.num_cached_tokens // self.engine.cache_spec.block_size
            until = time.monotonic() + self.lease_s
            if skip < len(blocks):
                try:
                    self.receiver.expect(request_id, src, blocks[skip:], until)
                except Exception:
                    self.engine.finish(req, RequestStatus.FINISHED_ERROR)  # give the blocks back
                    raise
            else:  # every block cached here already: nothing to land
                self.engine.kv_received([request_id])
            self.pending[request_id] = _Pending(req, until)
            return Reservation(self.receiver.address, list(blocks), skip, self.lease_s)

        return await self._on_loop(reserve)

    async def renew(self, request_ids: list[str]) -> list[str]:
        """Extend the leases of these reservations by `lease_s`; returns the ids no longer reserved here."""
        until = time.monotonic() + self.lease_s
        # NOTE: answered on the actor thread, not the engine loop's: a renewal must not wait for a step
        # (a float store per entry; the loop thread only reads it)
        gone = []
        for rid in request_ids:
            pending = self.pending.get(rid)
            if pending is None:
                # NOTE: admitted already (its first token came before its KV finished landing), or even
                # finished since: not lapsed
                if rid not in self.engine.requests and rid not in self.admitted:
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

        return await self._on_loop(start)

    async def pause(self, request_ids: list[str]) -> None:
        """Backpressure: hold these sequences out of the batch (blocks kept) until `resume`."""
        await self._on_loop(lambda: [self.engine.pause(r) for r in request_ids])

    async def resume(self, request_ids: list[str]) -> None:
        await self._on_loop(lambda: [self.engine.resume(r) for r in request_ids if r not in self.held])

    # -- draining: a running sequence leaves with its KV --------------------------------------------------

    async def hold(self, request_id: str) -> int | None:
        """Take a decoding sequence out of the batch for good (its blocks kept) and return how many tokens
        it has produced here; its KV then covers every token but the last. None when it is not decoding
        (finished, aborted, preempted for recompute, or still waiting for its KV)."""

        def hold() -> int | None:
            req = self.engine.requests.get(request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                return None
            if not self.engine.hold(request_id):
                return None  # preempted: its KV is gone, only recompute can move it
            self.held.add(request_id)
            assert req.num_computed_tokens == req.num_tokens - 1, "a held sequence's KV is one token behind"
            return len(req.output_token_ids)

        return await self._on_loop(hold)

    async def connect(self, peers: list) -> None:
        """Open KV links to these decode workers' receivers (`kv_transfer.PeerAddress`) ahead of moves."""
        assert self.sender is not None, "connect() on a colocated worker"
        for peer in peers:
            self.sender.connect(peer)

    async def send_kv(self, request_id: str, dst_key: str, reservation: Reservation,
                      timeout_s: float) -> KVMoveResult:
        """Push held `request_id`'s KV into `reservation` (made on another decode worker for `dst_key`, with
        this worker named as the source); answers once the destination acknowledged every layer, or the
        transfer failed or outlived `timeout_s` (what is left of the router's bound on the move). The held
        sequence stays here until the router aborts it."""
        assert self.sender is not None, "send_kv() on a colocated worker"
        future = asyncio.get_running_loop().create_future()

        def begin() -> None:
            req = self.engine.requests.get(request_id)
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
                              time.monotonic() + timeout_s)
            for layer in range(self.engine.cache_spec.num_layers):  # all written long ago: ship them all
                self.sender.send_layer(dst_key, layer)
            self.moves[dst_key] = _Move(request_id, future, time.time(), (n - skip) * self.engine.cache_spec.bytes_per_block)

        await self._on_loop(begin)
        return await future

    async def kv_digest(self, request_id: str, num_tokens: int, start: int = 0) -> str:
        """SHA-256 of the K and V of the sequence's positions `start` to `num_tokens`, every layer: what a
        moved sequence's source and destination must agree on bit for bit (`--verify-kv-moves`)."""

        def digest() -> str:
            sha = self.engine.kv_digest(request_id, num_tokens, start)
            if sha is None:
                raise ValueError(f"request {request_id!r} holds no KV for {num_tokens} tokens on {self.worker_id}")
            return sha

        return await self._on_loop(digest)

    async def forget_kv(self, request_id: str, start: int) -> bool:
        """The KV this sequence holds from position `start` on differs from what was sent (`--verify-kv-moves`):
        out of the prefix cache with it, so no later prompt reuses it. False when that could not be done."""

        def forget() -> bool:
            if self.engine.forget_kv(request_id, start):
                return True
            logger.warning("%s: could not take %s's KV out of the prefix cache (%s engine, or the sequence "
                           "has ended)", self.worker_id, request_id, type(self.engine).__name__)
            return False

        return await self._on_loop(forget)

    # -- colocated --------------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        await self._on_loop(lambda: self.engine.enqueue(self.engine.make_request(request_id, prompt_token_ids,
                                                                                 params)))

    # -- the base's hooks -------------------------------------------------------------------------------

    def _info_fields(self) -> dict[str, Any]:
        return {"kv_address": self.receiver.address if self.receiver else None}

    def _transports(self) -> Iterable[Closable]:
        return [t for t in (self.receiver, self.sender) if t is not None]

    def _attempt_keys(self) -> Iterable[str]:
        return {*self.pending, *self.engine.requests}

    def _forget_router(self, router_id: RouterId, final: bool) -> None:
        self.steps.forget(router_id, final)

    def _describe(self) -> dict:
        return {"pending": {rid: {"landed": p.landed, "first_token": p.first_token,
                                  "transfer": self.receiver.poll(rid).name if not p.landed else None}
                            for rid, p in self.pending.items()},
                "requests": {rid: r.status.name for rid, r in self.engine.requests.items()},
                "paused": sorted(self.engine.paused), "held": sorted(self.held),
                "moves": sorted(self.moves)}

    # -- on the loop thread -----------------------------------------------------------------------------

    def _abort(self, request_id: str, reason: str = "aborted by the router") -> None:
        # NOTE: the transfer is failed before the blocks are freed, so no late layer lands in them
        if self.pending.pop(request_id, None) is not None and self.receiver is not None:
            self.receiver.abort(request_id)
        if request_id in self.held:  # a move still reading its blocks ends before they are freed
            self.held.discard(request_id)
            for dst_key in [k for k, m in self.moves.items() if m.src == request_id]:
                self.sender.abort(dst_key, "the moved sequence was aborted at its source")
        self.engine.abort_request(request_id)

    def _admit_if_ready(self, pending: _Pending) -> None:
        if not pending.landed or pending.first_token is None:
            return
        req = pending.request
        del self.pending[req.request_id]
        self.admitted[req.request_id] = None
        if len(self.admitted) > ADMITTED_MEMORY:
            self.admitted.popitem(last=False)
        if self.engine.kv_landed(req, pending.first_token):  # the first token already ends it
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
                self.engine.finish(pending.request, RequestStatus.FINISHED_ERROR)
                failed.append(TokenDelta(rid, [], FinishReason.ERROR, error="the reservation's lease lapsed"))
        landed = []
        for result in self.receiver.pop_finished():
            pending = self.pending.get(result.request_id)
            if pending is None:
                continue
            if result.ok:
                landed.append(pending)
            else:
                del self.pending[result.request_id]
                self.engine.finish(pending.request, RequestStatus.FINISHED_ERROR)
                failed.append(TokenDelta(result.request_id, [], FinishReason.ERROR, error=result.error))
        # the receiver's finished ids move their requests on (WAITING_FOR_KV -> KV_LANDED), as vLLM's
        # scheduler moves WAITING_FOR_REMOTE_KVS on its connector's finished_recving
        self.engine.kv_received([p.request.request_id for p in landed])
        for pending in landed:
            self._admit_if_ready(pending)
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
        self.steps.publish(out)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        self._on_step(StepOutput(None, time.time(), deltas, self.engine.load()))


