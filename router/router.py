"""The router's core: place each request by phase and locality, drive it through the workers, stream it.

Disaggregated path, per request:
  1. prefill worker = lowest cost of (uncached prompt tokens + queued prefill tokens) (`choose_prefill`);
  2. decode worker = same node as that prefill worker when one has room, else most free blocks
     (`choose_decode`); `reserve` there returns the destination blocks, or None when it is out of room, in
     which case the request waits in a bounded admission queue (past the bound: RESOURCE_EXHAUSTED);
  3. `prefill` on the prefill worker computes the prompt, pushes its KV layer by layer into the reserved
     blocks and answers with the first token;
  4. `start` on the decode worker, whose per-step messages (one per step for all its sequences) a single
     consumer task per decode worker fans out to the requests' queues.
Colocated path: one colocated worker does both phases; same streams, same events.

Every way out of `generate` — finished, cancelled by the client, failed — leaves no blocks held: the
`finally` tells every worker that may hold something for the request to free it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import hash_blocks
from engine.config import cdiv
from engine.engine_loop import StepOutput, TokenDelta
from engine.worker_types import LoadReport
from router.observer import RequestObserver
from router.placement import PoolKind, PrefillChoice, RoundRobinPrefill, choose_decode, choose_prefill
from router.pool import Worker
from router.prefix_index import PrefixIndex
from router.validation import ValidatedRequest

if TYPE_CHECKING:
    from decode_worker import Reservation

logger = logging.getLogger(__name__)


class RouterError(Exception):
    """A request that cannot be served; `code` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Timing:
    """Seconds spent in each stage before the first token (and the first decode step after it)."""

    queue: float = 0.0  # arrival -> prefill scheduled (admission wait, placement, worker queue)
    prefill: float = 0.0  # prefill scheduled -> first token sampled
    kv_transfer: float = 0.0  # first token sampled -> KV landed on the decode worker
    decode_admit: float = 0.0  # first token out -> first decode step's token out


@dataclass
class RouterEvent:
    """New tokens of one request; the last event has `finish_reason` set."""

    token_ids: list[int]
    finish_reason: str | None = None
    first: bool = False  # the event carrying the first token
    time: float = field(default_factory=time.time)


@dataclass
class RequestState:
    request_id: str
    queue: asyncio.Queue  # (TokenDelta, step time) from a decode/colocated worker's stream
    arrival: float = field(default_factory=time.time)
    pool: str = ""  # the pool whose TTFT this is: "prefill" or "colocated"
    prefill_worker: str = ""
    decode_worker: str = ""
    num_cached_tokens: int = 0
    timing: Timing = field(default_factory=Timing)
    finished: bool = False


class Router:
    def __init__(self, block_size: int, policy: str = "prefix",
                 max_queue: int = 256, admission_timeout_s: float = 60.0,
                 observer: RequestObserver | None = None) -> None:
        if policy not in ("prefix", "round-robin"):
            raise ValueError(f"routing policy must be 'prefix' or 'round-robin', got {policy!r}")
        self.workers: dict[str, Worker] = {}
        self.block_size = block_size
        self.choose_prefill = choose_prefill if policy == "prefix" else RoundRobinPrefill()
        self.max_queue = max_queue
        self.admission_timeout_s = admission_timeout_s
        self.index = PrefixIndex()
        self.inflight: dict[str, RequestState] = {}
        self.num_queued = 0
        self._room = asyncio.Event()  # set whenever blocks may have been freed somewhere
        self._tasks: set[asyncio.Task] = set()
        self.observer = observer or RequestObserver()

    @property
    def disaggregated(self) -> bool:
        return any(w.kind is PoolKind.PREFILL for w in self.workers.values())

    def add_worker(self, worker: Worker) -> None:
        """A worker is up: place requests on it (and listen to its steps, if it decodes)."""
        self.workers[worker.worker_id] = worker
        if worker.kind.decodes:
            self._spawn(self._consume_steps(worker))
        self._room.set()

    def remove_worker(self, worker: Worker) -> None:
        """A worker is gone: never place on it again, and end the requests it was serving."""
        worker.mark_dead()
        self.index.remove_worker(worker.worker_id)
        self.observer.on_worker_lost(worker)
        for state in list(self.inflight.values()):
            if worker.worker_id in (state.decode_worker, state.prefill_worker):
                state.queue.put_nowait((None, time.time()))

    async def close(self) -> None:
        """Stop listening to the workers (the deployment is shutting down)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def apply_report(self, worker: Worker, report: LoadReport) -> None:
        worker.apply(report)
        self.observer.on_report(worker, report)
        if worker.kind.prefills:
            self.index.apply(worker.worker_id, report.stored, report.removed)
        self._room.set()

    # -- one request ------------------------------------------------------------------------------------

    async def generate(self, req: ValidatedRequest) -> AsyncIterator[tuple[RouterEvent, RequestState]]:
        rid = req.request_id
        if rid in self.inflight:
            raise RouterError("ALREADY_EXISTS", f"request_id: {rid!r} is already in flight")
        state = self.inflight[rid] = RequestState(rid, asyncio.Queue())
        arrival = state.arrival
        try:
            path = self._disaggregated if self.disaggregated else self._colocated
            async for event in path(req, state, arrival):
                if event.finish_reason is not None:
                    state.finished = True
                yield event, state
                if state.finished:
                    return
        finally:
            del self.inflight[rid]
            if not state.finished:  # cancelled or failed: free whatever the workers hold for it
                for wid in {state.prefill_worker, state.decode_worker} - {""}:
                    self._spawn(self._abort(self.workers[wid], rid))

    async def _colocated(self, req: ValidatedRequest, state: RequestState,
                         arrival: float) -> AsyncIterator[RouterEvent]:
        ids = req.prompt_token_ids
        choice = self._choose_prefill(ids)
        worker = self.workers[choice.worker_id]
        state.prefill_worker = state.decode_worker = worker.worker_id
        state.pool = PoolKind.COLOCATED.value
        await self._call(worker, worker.actor.submit.remote(req.request_id, ids, req.params))
        first = True
        while True:
            delta, step_time = await self._next_delta(state, worker)
            if first:
                state.timing.queue = step_time - arrival  # the colocated engine queues and prefills in one
                state.num_cached_tokens = delta.num_cached_tokens
            yield self._event(delta, first)
            first = False
            if delta.finish_reason is not None:
                return

    async def _disaggregated(self, req: ValidatedRequest, state: RequestState,
                             arrival: float) -> AsyncIterator[RouterEvent]:
        rid, ids = req.request_id, req.prompt_token_ids
        choice = self._choose_prefill(ids)
        prefill = self.workers[choice.worker_id]
        state.prefill_worker = prefill.worker_id
        state.pool = PoolKind.PREFILL.value
        # NOTE: counted from the moment of choice, so a burst of requests placed together spreads out
        todo = len(ids) - choice.cached_blocks * self.block_size
        prefill.inflight_prefill_tokens += todo
        try:
            decode, reservation = await self._reserve(req, prefill)
            state.decode_worker = decode.worker_id
            result = await self._call(prefill, prefill.actor.prefill.remote(
                rid, ids, req.params, reservation.kv_address, reservation.block_ids,
                reservation.num_cached_blocks))
        finally:
            prefill.inflight_prefill_tokens -= todo
        if result.report is not None:
            self.apply_report(prefill, result.report)
        if result.kv_bytes or result.kv_failed:
            self.observer.on_kv_transfer(prefill.worker_id, decode.worker_id, result.kv_seconds,
                                         result.kv_bytes, result.ok)
        if not result.ok:
            raise RouterError("UNAVAILABLE", f"prefill on {prefill.worker_id} failed: {result.error}")
        t = state.timing
        t.queue = result.scheduled_at - arrival
        t.prefill = result.sampled_at - result.scheduled_at
        t.kv_transfer = result.kv_done_at - result.sampled_at
        state.num_cached_tokens = result.num_cached_tokens
        if result.finish_reason is not None:  # the first token ends it: release the reservation
            state.finished = True
            self._spawn(self._abort(decode, rid))
        first_out = time.time()
        yield RouterEvent([result.first_token], result.finish_reason, first=True)
        if result.finish_reason is not None:
            return

        await self._call(decode, decode.actor.start.remote(rid, result.first_token))
        first = True
        while True:
            delta, _ = await self._next_delta(state, decode)
            if first and delta.token_ids:
                t.decode_admit = time.time() - first_out
                first = False
            yield self._event(delta, False)
            if delta.finish_reason is not None:
                return

    # -- placement and admission ------------------------------------------------------------------------

    def _choose_prefill(self, ids: list[int]) -> PrefillChoice:
        loads = [w.snapshot() for w in self.workers.values() if w.kind.prefills]
        choice = self.choose_prefill(hash_blocks(ids, self.block_size), loads, self.index, self.block_size,
                                     len(ids))
        if choice is None:
            raise RouterError("UNAVAILABLE", "no live prefill worker; check the prefill pool")
        return choice

    async def _reserve(self, req: ValidatedRequest, prefill: Worker) -> tuple[Worker, Reservation]:
        """A decode worker with room for the prompt's blocks, waiting in the admission queue if none has."""
        need = cdiv(req.num_prompt_tokens, self.block_size)
        decoders = [w for w in self.workers.values() if w.kind is PoolKind.DECODE and w.alive]
        if not decoders:
            raise RouterError("UNAVAILABLE", "no live decode worker; check the decode pool")
        largest = max(w.load.total_blocks for w in decoders)
        if need > largest:
            raise RouterError("RESOURCE_EXHAUSTED", f"prompt needs {need} KV blocks but the largest decode "
                              f"worker holds {largest}; shorten the prompt or give decode workers more memory")
        deadline = time.monotonic() + self.admission_timeout_s
        while True:
            tried: set[str] = set()
            while True:
                loads = [w.snapshot() for w in decoders if w.worker_id not in tried and w.alive]
                wid = choose_decode(prefill.info.node_id, need, loads)
                if wid is None:
                    break
                tried.add(wid)
                decode = self.workers[wid]
                reservation = await self._call(decode, decode.actor.reserve.remote(
                    req.request_id, req.prompt_token_ids, req.params, prefill.worker_id))
                if reservation is not None:
                    return decode, reservation
                decode.load = dataclasses.replace(decode.load, free_blocks=0)  # until its next report
            if self.num_queued >= self.max_queue:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode worker has room for {need} KV blocks and "
                                  f"the admission queue is full ({self.max_queue} waiting); retry later")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode worker had room for {need} KV blocks "
                                  f"within {self.admission_timeout_s:.0f}s; retry later")
            self.num_queued += 1
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), timeout=min(remaining, 0.5))
            except asyncio.TimeoutError:
                pass
            finally:
                self.num_queued -= 1

    # -- worker streams ---------------------------------------------------------------------------------

    async def _consume_steps(self, worker: Worker) -> None:
        """Fan one decode worker's per-step messages out to its requests, for as long as it lives."""
        import ray

        try:
            async for ref in worker.actor.stream_steps.options(num_returns="streaming").remote():
                out: StepOutput = await ref
                if out.load is not None:
                    self.apply_report(worker, LoadReport(worker.worker_id, out.load))
                for delta in out.deltas:
                    state = self.inflight.get(delta.request_id)
                    if state is not None:
                        state.queue.put_nowait((delta, out.time))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            logger.error("decode worker %s stream ended: %s", worker.worker_id, e)
        self.remove_worker(worker)

    async def _next_delta(self, state: RequestState, worker: Worker) -> tuple[TokenDelta, float]:
        delta, step_time = await state.queue.get()
        if delta is None:
            raise RouterError("UNAVAILABLE", f"worker {worker.worker_id} died while serving the request")
        if delta.finish_reason in ("error", "abort"):
            raise RouterError("UNAVAILABLE" if delta.finish_reason == "error" else "ABORTED",
                              f"worker {worker.worker_id} ended the request: {delta.finish_reason}")
        if delta.finish_reason is not None:
            self._room.set()
        return delta, step_time

    @staticmethod
    def _event(delta: TokenDelta, first: bool) -> RouterEvent:
        return RouterEvent(list(delta.token_ids), delta.finish_reason, first)

    async def _call(self, worker: Worker, ref):
        import ray

        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            self.remove_worker(worker)
            raise RouterError("UNAVAILABLE", f"worker {worker.worker_id} is gone: {e}") from e

    async def _abort(self, worker: Worker, request_id: str) -> None:
        if not worker.alive:
            return
        try:
            await worker.actor.abort.remote(request_id)
        except Exception as e:  # noqa: BLE001 - best effort; a dead worker holds nothing
            logger.warning("abort of %s on %s failed: %s", request_id, worker.worker_id, e)
        self._room.set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
