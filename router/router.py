"""The request driver: each request's attempts, from placement to its last token.

`generate` runs a request's attempts (`_run`) until one finishes it. Each attempt takes one path, its phases
in order (see `router.lifecycle` for the request's phases):
  - colocated (`_colocated`): one colocated worker prefills and decodes (`_local`);
  - disaggregated (`_disaggregated`): placed by `Admission` (`router.admission`) either on the local path, its
    decode worker prefilling the prompt itself (`_local`), or on the remote path (`_remote`): `prefill` on the
    prefill worker computes the prompt, pushes its KV layer by layer into the reserved blocks and answers with
    the first token; `start` on the decode worker admits it, and its tokens come from that worker's step
    stream (`_decode`, `router.step_streams`).

An attempt that fails — its prefill or decode worker lost, its KV transfer failed, its reservation lapsed —
is followed by another with the tokens streamed so far appended to the prompt (migration by recompute), up
to `migration_limit` times; a worker lost while the request waits on the *other* phase does not touch it.
A drained decode worker's sequence is moved with its KV instead (`router.drains`). Every way out of
`generate` — finished, cancelled by the client, failed — leaves no blocks held: each attempt, when it ends,
tells the workers that may hold something for it to free it (`_end_attempt`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.config import cdiv
from protocol import Cause, Method, Path, PoolKind
from protocol.messages import DestinationWanted, PrefillResult
from router.admission import Admission
from router.cache_view import CacheView
from router.config import RouterConfig
from router.drains import Drains, KVMove
from router.kv_checks import KVCheck, check_transfer
from router.lifecycle import Attempt, AttemptFailed, Phase, RequestState, Timing
from router.observer import RequestObserver
from router.registry import Worker, WorkerRegistry
from router.shared import RouterError, Shared
from router.step_streams import StepStreams
from router.validation import ValidatedRequest
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)

__all__ = ["KVMove", "Router", "RouterConfig", "RouterError", "RouterEvent", "RequestState", "Timing"]


@dataclass
class RouterEvent:
    """New tokens of one request; the last event has `finish_reason` set."""

    token_ids: list[int]
    finish_reason: str | None = None
    first: bool = False  # the event carrying the first token
    time: float = field(default_factory=time.time)


class Router:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry | None = None,
                 observer: RequestObserver | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.registry = registry or WorkerRegistry()
        self.shared = Shared(config, self.registry, observer or RequestObserver())
        self.cache = CacheView(self.shared)
        self.admission = Admission(self.shared)
        self.streams = StepStreams(self.shared, self.cache, self.admission)
        self.drains = Drains(self.shared, self._end_attempt)
        self.registry.on_added.append(self.streams.on_worker_added)
        self.registry.on_lost.append(self.streams.on_worker_lost)
        self.index = self.shared.index
        self.cost = self.shared.cost
        self.observer.watch_cost(self.cost)
        self._attempts = self.shared.attempts  # by attempt key: where worker messages are routed
        self._room = self.shared.room  # set whenever blocks may have been freed or a worker joined
        self.requests: dict[str, RequestState] = {}  # by router id
        self._by_client_id: dict[str, RequestState] = {}
        self._ids = itertools.count(1)
        # NOTE: attempt keys carry their router replica (`protocol.messages.owner_of`): workers send each
        # replica only its own tokens, and free what a dead replica held
        self._id_prefix = "" if config.router_id is None else f"{config.router_id}/"
        self.draining = False
        # the parts' public faces, as the servicer, the pool manager and the admin API call them
        self.apply_report = self.cache.apply_report
        self.cache_cursor = self.cache.cache_cursor
        self.on_heartbeat = self.admission.on_heartbeat
        self.holds_work = self.drains.holds_work
        self.drain_worker = self.drains.drain_worker
        self.kv_moves = self.drains.kv_moves
        self.kv_checks: collections.deque[KVCheck] = collections.deque(maxlen=1024)  # --verify-kv-moves

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    @property
    def observer(self) -> RequestObserver:
        return self.shared.observer

    @observer.setter
    def observer(self, observer: RequestObserver) -> None:
        self.shared.observer = observer  # every part reads it from there

    @property
    def disaggregated(self) -> bool:
        return self.shared.disaggregated

    @property
    def num_queued(self) -> int:
        """Requests waiting in the admission queue for KV room."""
        return self.admission.queue.num_queued

    async def close(self) -> None:
        """Stop listening to the workers (the deployment is shutting down)."""
        await self.shared.background.close()

    async def drain(self, grace_s: float) -> bool:
        """Admit nothing more; wait up to `grace_s` for the requests in flight. True if all finished."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.requests

    # -- one request ------------------------------------------------------------------------------------

    async def generate(self, req: ValidatedRequest) -> AsyncIterator[tuple[RouterEvent, RequestState]]:
        if self.draining:
            raise RouterError("UNAVAILABLE", "the server is shutting down and admits no new request; "
                              "retry on another replica")
        if req.request_id in self._by_client_id:
            raise RouterError("ALREADY_EXISTS", f"request_id: {req.request_id!r} is already in flight")
        state = RequestState(f"{self._id_prefix}r{next(self._ids)}", req)
        self.requests[state.id] = self._by_client_id[req.request_id] = state
        try:
            # NOTE: aclosing, so the attempt in flight is ended (and its workers told) as soon as this
            # stream ends, not whenever the garbage collector finalizes the inner generators
            async with contextlib.aclosing(self._run(state)) as events:
                async for event in events:
                    if state.migrating_since is not None and event.token_ids:
                        self.observer.on_migration_pause(state.last_method.value,
                                                         event.time - state.migrating_since)
                        state.migrating_since = None
                    state.generated += event.token_ids
                    state.last_event_at = event.time
                    if event.finish_reason is not None:
                        state.to(Phase.FINISHED)
                    yield event, state
                    if state.finished:
                        return
        except RouterError:
            state.to(Phase.FAILED)
            raise
        finally:
            if not state.finished:
                state.to(Phase.CANCELLED)
            del self.requests[state.id]
            del self._by_client_id[req.request_id]

    async def _run(self, state: RequestState) -> AsyncIterator[RouterEvent]:
        """Attempts until one finishes the request, or the migration limit is spent."""
        moved: Attempt | None = None  # an attempt that took over a drained sequence with its KV
        while True:
            att, moved = moved or state.new_attempt(), None
            self._attempts[att.key] = att
            clean = False
            try:
                # NOTE: placed here, not in a generator of its own: one async hop less between a token and the client
                path = self._decode(state, att, att.decode) if att.moved_from is not None else await self._placed(state, att)
                async with contextlib.aclosing(path) as events:
                    async for event in events:
                        # the last event: the workers ended the attempt themselves, nothing to abort
                        clean = event.finish_reason is not None
                        yield event
                return
            except AttemptFailed as e:
                state.to(Phase.MIGRATING)
                state.migrating_since = state.last_event_at or time.time()
                if e.cause is Cause.DRAIN:
                    assert att.move is not None
                    if att.move.method is Method.KV:
                        moved = await self.drains.move_kv(state, att)
                    method = Method.KV if moved is not None else Method.RECOMPUTE
                    state.last_method = method
                    self.workers[att.move.worker_id].moved[method] += 1
                    self.observer.on_migration(state, e.cause.value, method.value)
                    if moved is not None:
                        state.to(Phase.DECODING)
                        continue
                    state.to(Phase.QUEUED)
                    continue
                state.failures.append(e)
                state.last_method = Method.RECOMPUTE
                self.observer.on_migration(state, e.cause.value, Method.RECOMPUTE.value)
                logger.warning("request %s (%s) attempt %s failed: %s", state.id, state.client_id, att.key, e)
                if len(state.failures) > self.config.migration_limit:
                    # NOTE: the causes are for the log only: a worker's failure text carries node addresses and
                    # tracebacks, which clients must not see
                    logger.error("request %s (%s) failed %d times: %s", state.id, state.client_id,
                                 len(state.failures), "; ".join(str(f) for f in state.failures))
                    causes = "; ".join(f"{f.cause.value} on {f.worker_id}" for f in state.failures)
                    raise RouterError("UNAVAILABLE", f"request {state.client_id!r} failed {len(state.failures)} "
                                      f"times (--migration-limit {self.config.migration_limit}): {causes}; the "
                                      f"server's log has the details under {state.id}") from e
                state.to(Phase.QUEUED)
            finally:
                self._end_attempt(att, clean)

    def _end_attempt(self, att: Attempt, clean: bool) -> None:
        """The attempt is over: route nothing more to it, and free what its workers may hold for it."""
        del self._attempts[att.key]
        self.admission.unpromise(att)
        if clean:
            return  # the workers ended it themselves (finished), and the reservation was released
        for worker in {att.prefill, att.decode} - {None}:
            if worker.alive:
                self.shared.abort_soon(worker, att.key)
        self._room.set()

    async def _placed(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        """Place a fresh attempt; the phases of the path it was given (each path's workers are named on `att`)."""
        if not self.disaggregated:
            choice = await self.admission.choose_prefill(att)
            worker = self.workers[choice.worker_id]
            # the prompt and its first token must fit one worker's cache (else every attempt would fail alike)
            self.admission.check_fits(cdiv(len(att.prompt) + 1, self.block_size), [worker], PoolKind.COLOCATED)
            att.prefill = att.decode = worker
            return self._local(state, att)
        path = await self.admission.place(att)
        self.observer.on_placement(path.value)
        return self._local(state, att) if path is Path.LOCAL else self._remote(state, att)

    async def _local(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        """One worker prefills and decodes the attempt: a colocated worker, or a decode worker given a prompt
        short enough to prefill itself (no prefill queue, no KV transfer)."""
        worker = att.decode
        state.to(Phase.PREFILLING)
        first_attempt = not state.generated
        if first_attempt:
            state.pool = worker.kind
            state.placement = Path.LOCAL if worker.kind is PoolKind.DECODE else PoolKind.COLOCATED
        state.prefill_worker = state.decode_worker = worker.worker_id
        try:
            await worker.client.submit(att.key, att.prompt, att.params, self.config.call_timeout_s)
        except WorkerError as e:
            raise self.shared.call_failed(worker, e, Cause.DECODE_LOST) from e
        while True:
            delta = await self.streams.next_delta(att, worker)
            if state.phase is Phase.PREFILLING:
                # NOTE: the cost model learns this worker's prefill rate from its step stream, where it can
                # tell the prompt's chunks from the decode steps they rode (`StepStreams.consume_steps`)
                if first_attempt:
                    state.timing.queue = time.time() - state.arrival  # the engine queues and prefills in one
                    state.num_cached_tokens = delta.num_cached_tokens
                state.to(Phase.DECODING)
            att.num_output += len(delta.token_ids)
            yield RouterEvent(list(delta.token_ids), delta.finish_reason, first=not state.generated)
            if delta.finish_reason is not None:
                return
            att.check_move()

    async def _remote(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        """The prefill worker computes the prompt and ships its KV to the decode worker reserved for it
        (`Admission.place` chose both and counted the prompt in the prefill worker's queue)."""
        prefill, decode = att.prefill, att.decode
        queued = att.prefill_tokens  # of the prompt's tokens counted in the prefill worker's queue
        first = not state.generated
        first_out: float | None = None
        result: PrefillResult | None = None
        try:
            state.to(Phase.PREFILLING)
            async with contextlib.aclosing(self.streams.prefill_items(att, prefill)) as items:
                async for item in items:
                    if isinstance(item, PrefillResult):
                        result = item
                        continue
                    if isinstance(item, DestinationWanted):
                        # NOTE: all but its last horizon of tokens are computed: a prompt held for decode room
                        # must not make its prefill worker look busy to placement meanwhile
                        left = min(queued, prefill.info.destination_horizon_tokens)
                        self.admission.uncount_prefill(prefill, queued - left)
                        queued = left
                        decode = await self.admission.reserve_late(att, prefill)
                        continue
                    self.admission.uncount_prefill(prefill, queued)
                    queued = 0
                    self.cost.observe_prefill(prefill.worker_id, len(att.prompt) - item.num_cached_tokens,
                                              item.compute_s or item.sampled_at - item.scheduled_at)
                    if first:
                        t = state.timing
                        t.queue, t.prefill = item.scheduled_at - state.arrival, item.sampled_at - item.scheduled_at
                        state.pool = PoolKind.PREFILL
                        state.placement = Path.REMOTE
                        state.num_cached_tokens = item.num_cached_tokens
                    state.prefill_worker, state.decode_worker = prefill.worker_id, decode.worker_id
                    att.num_output = 1
                    if item.finish_reason is not None:  # the first token ends it: free both sides
                        for worker in (decode, prefill):
                            self.shared.abort_soon(worker, att.key)
                        yield RouterEvent([item.token], item.finish_reason, first=first)
                        return
                    # NOTE: the first token goes out the moment it is sampled, before the KV has landed; the
                    # decode worker admits the sequence once both are in. Should the transfer fail, the next
                    # attempt starts from prompt + this token, so the client never sees it twice.
                    start = asyncio.ensure_future(decode.client.start(att.key, item.token, self.config.call_timeout_s))
                    first_out = time.time()
                    try:
                        yield RouterEvent([item.token], None, first=first)
                    finally:
                        if not start.done():  # the stream ends here (cancelled): let the call finish or fail
                            start.add_done_callback(lambda f: f.cancelled() or f.exception())
                    try:
                        started = await start
                    except WorkerError as e:
                        raise self.shared.call_failed(decode, e, Cause.DECODE_LOST) from e
                    if not started:
                        raise AttemptFailed(Cause.RESERVATION, decode.worker_id,
                                            "the reservation lapsed before decoding")
        finally:
            self.admission.uncount_prefill(prefill, queued)
        if result is None:
            raise AttemptFailed(Cause.WORKER_ERROR, prefill.worker_id, "the prefill stream ended without an outcome")
        if result.report is not None and prefill.alive:
            self.cache.apply_report(prefill, result.report)
        if result.kv_bytes or result.kv_failed:
            self.observer.on_kv_transfer(prefill.worker_id, decode.worker_id, result.kv_seconds,
                                         result.kv_bytes, result.ok)
            if result.ok:
                self.cost.observe_transfer(prefill.worker_id, decode.worker_id, result.kv_bytes, result.kv_seconds)
        if not result.ok:
            if att.lost_notice is not None:  # the decode worker died under the transfer
                raise AttemptFailed(Cause.DECODE_LOST, att.lost_notice.worker_id, att.lost_notice.reason)
            cause = Cause.KV_TRANSFER if result.kv_failed else Cause.WORKER_ERROR
            raise AttemptFailed(cause, prefill.worker_id, result.error or "prefill failed")
        if result.kv_digest is not None:
            start = att.reservation.sent_from(self.block_size) if att.reservation is not None else 0
            await check_transfer(state.id, att, prefill, decode, result.kv_digest, start,
                                 self.config.call_timeout_s, self.kv_checks)
        if first:
            state.timing.kv_transfer = result.kv_done_at - result.sampled_at
        state.to(Phase.DECODING)
        att.check_move()
        async with contextlib.aclosing(self._decode(state, att, decode, first_out if first else None)) as events:
            async for event in events:
                yield event

    async def _decode(self, state: RequestState, att: Attempt, decode: Worker,
                      first_out: float | None = None) -> AsyncIterator[RouterEvent]:
        """The decoding attempt's tokens, from its decode worker's step stream, until it finishes.
        `first_out`: when the request's first token went out, to time its first decode step."""
        while True:
            delta = await self.streams.next_delta(att, decode)
            if first_out is not None and delta.token_ids:
                state.timing.decode_admit = time.time() - first_out
                first_out = None
            att.num_output += len(delta.token_ids)
            yield RouterEvent(list(delta.token_ids), delta.finish_reason)
            if delta.finish_reason is not None:
                return
            att.check_move()
