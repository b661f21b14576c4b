"""The router's core: place each request by phase and locality, drive its attempts, stream it.

Disaggregated attempt (see `router.lifecycle` for the request's phases):
  1. prefill worker = lowest cost of (uncached prompt tokens + queued prefill tokens) (`choose_prefill`),
     among live workers whose queued prefill tokens stay under `max_queued_prefill_tokens`;
  2. decode worker = same node as that prefill worker when one has room, else most free blocks
     (`choose_decode`); `reserve` there returns the destination blocks as a lease, or None when it is out
     of room, in which case the request waits in a bounded admission queue (past the bound:
     RESOURCE_EXHAUSTED at once, before any prefill). The lease is renewed on every heartbeat of the
     prefill worker, so it lasts as long as the prefill makes progress, however long that is. A prompt
     longer than its prefill worker's horizon is reserved late instead, when that worker nears its last
     chunk (`_may_defer`, `_reserve_late`): blocks reserved at placement would sit idle while it queues;
  3. `prefill` on the prefill worker computes the prompt, pushes its KV layer by layer into the reserved
     blocks and answers with the first token;
  4. `start` on the decode worker, whose per-step messages (one per step for all its sequences) a single
     consumer task per decode worker fans out to the attempts' queues.
Colocated attempt: one colocated worker does both phases; same streams, same events.

An attempt that fails — its prefill or decode worker lost, its KV transfer failed, its reservation lapsed —
is followed by another with the tokens streamed so far appended to the prompt (migration by recompute), up
to `migration_limit` times; a worker lost while the request waits on the *other* phase does not touch it.
Every way out of `generate` — finished, cancelled by the client, failed — leaves no blocks held: each
attempt, when it ends, tells the workers that may hold something for it to free it.

Draining a worker (`drain_worker`: scale down, rolling restart, maintenance) stops placement on it, lets what
it prefills finish, and moves each sequence it decodes to another decode worker *with its KV*: the sequence is
held there (`hold`), blocks for its prompt + tokens so far are reserved elsewhere, its KV is pushed
decode → decode over `kv_transfer` (`send_kv`), and a new attempt decodes on from the last streamed token.
Nothing is recomputed, and the client sees one pause. A move that cannot happen falls back to recompute.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.config import cdiv
from protocol import Cause, Method, Path, PoolKind
from protocol.block_hash import hash_blocks
from protocol.messages import (
    DestinationWanted,
    FirstToken,
    KVMoveResult,
    LoadReport,
    PrefillResult,
    Reservation,
    TokenDelta,
)
from router.background import Background
from router.cost_model import CostModel, CostPriors
from router.lifecycle import (
    Attempt,
    AttemptFailed,
    MoveNotice,
    Notice,
    Phase,
    RequestState,
    Timing,
    WorkerLostNotice,
)
from router.observer import RequestObserver
from router.placement import PrefillChoice, RoundRobinPrefill, choose_decode, choose_path, choose_prefill
from router.pool import Worker, WorkerRegistry
from router.prefix_index import PrefixIndex
from router.validation import ValidatedRequest
from router.worker_client import Failure, WorkerError

logger = logging.getLogger(__name__)

__all__ = ["KVMove", "Router", "RouterConfig", "RouterError", "RouterEvent", "RequestState", "Timing"]


class RouterError(Exception):
    """A request that cannot be served; `code` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RouterEvent:
    """New tokens of one request; the last event has `finish_reason` set."""

    token_ids: list[int]
    finish_reason: str | None = None
    first: bool = False  # the event carrying the first token
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class KVMove:
    """One drain move, as the router saw it (kept for operators and tests: `Router.kv_moves`)."""

    request_id: str
    src: str
    dst: str
    num_tokens: int  # KV positions moved (prompt + generated, all but the last token)
    result: KVMoveResult
    src_digest: str | None = None  # set with --verify-kv-moves
    dst_digest: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    policy: str = "prefix"  # "prefix" | "round-robin"
    max_queue: int = 256  # requests waiting for KV room before RESOURCE_EXHAUSTED
    admission_timeout_s: float = 60.0  # a request waits this long for room or a live worker, then fails
    # a prefill worker takes no new prompt while this many prompt tokens wait on it (the one exception: an
    # idle worker takes any prompt the model admits)
    max_queued_prefill_tokens: int = 65536
    migration_limit: int = 3  # attempts after the first, per request
    call_timeout_s: float = 10.0  # reserve/start/submit/abort: the worker answers between two steps
    # backpressure: a stream with this many undelivered decode steps is paused on its decode worker, and
    # resumed once the client has read it down to a quarter of that
    max_buffered_steps: int = 64
    # "joint": the (prefill, decode) pair -- or the decode worker alone for a short uncached prompt -- with the
    # lowest estimated time until the request decodes (router.cost_model); "separate": the prefill worker by
    # prefix and load, then a decode worker for it by node and free blocks (the baseline)
    placement: str = "joint"
    # joint placement may prefill a prompt on its decode worker when that is cheaper (off by default: it trades
    # the decode worker's streams' ITL for the request's TTFT, which the operator must choose to do)
    local_prefill: bool = False
    local_chunk_tokens: int = 0  # the most prompt tokens a decode worker's step computes (0: no cap)
    # a prompt longer than its prefill worker's horizon (`WorkerInfo.destination_horizon_tokens`) gets its
    # decode blocks when that worker nears its last chunk, not at placement: they would sit idle meanwhile
    late_reservation: bool = True
    # the share of each decode worker's cache this router may promise to such prompts: 1 / the number of
    # router replicas, which promise independently, so that together they promise at most one cache
    promise_share: float = 1.0
    kv_move_timeout_s: float = 60.0  # a drain's KV move (reserve, push every layer, start) must end in this
    # compare a SHA-256 of every moved sequence's KV at the source and the destination before decoding on
    # (a full read of its KV on both: a debugging and proof aid, off in production)
    verify_kv_moves: bool = False
    cost_priors: CostPriors = field(default_factory=CostPriors)  # the cost model's stand-ins (router.cost_model)
    router_id: str = ""  # this replica's id among several (`pdserve serve --routers N`); unique per incarnation

    def __post_init__(self) -> None:
        if self.policy not in ("prefix", "round-robin"):
            raise ValueError(f"routing policy must be 'prefix' or 'round-robin', got {self.policy!r}")
        if self.placement not in ("joint", "separate"):
            raise ValueError(f"--placement must be 'joint' or 'separate', got {self.placement!r}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 < self.promise_share <= 1:
            raise ValueError(f"promise_share must be in (0, 1], got {self.promise_share}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.max_buffered_steps < 4:
            raise ValueError(f"max_buffered_steps must be >= 4, got {self.max_buffered_steps}")
        if self.max_queued_prefill_tokens < 1:
            raise ValueError(f"--max-queued-prefill-tokens must be >= 1, got {self.max_queued_prefill_tokens}")


class Router:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry | None = None,
                 observer: RequestObserver | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.registry = registry or WorkerRegistry()
        self.registry.on_added.append(self._on_worker_added)
        self.registry.on_lost.append(self._on_worker_lost)
        self.choose_prefill = choose_prefill if config.policy == "prefix" else RoundRobinPrefill()
        self.index = PrefixIndex()
        self.requests: dict[str, RequestState] = {}  # by router id
        self._by_client_id: dict[str, RequestState] = {}
        self._attempts: dict[str, Attempt] = {}  # by attempt key: where worker messages are routed
        self._ids = itertools.count(1)
        # NOTE: attempt keys carry their router replica (`protocol.messages.owner_of`): workers send each
        # replica only its own tokens, and free what a dead replica held
        self._id_prefix = f"{config.router_id}/" if config.router_id else ""
        self.num_queued = 0
        self.draining = False
        self._room = asyncio.Event()  # set whenever blocks may have been freed or a worker joined
        self._background = Background()
        self.observer = observer or RequestObserver()
        self.kv_moves: collections.deque[KVMove] = collections.deque(maxlen=1024)
        # (it learns the KV bytes per token from the first worker)
        self.cost = CostModel(bytes_per_token=0, priors=config.cost_priors)
        self.observer.watch_cost(self.cost)
        self._aborts: dict[str, set[asyncio.Task]] = {}  # by worker id: aborts sent, not yet answered

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    @property
    def disaggregated(self) -> bool:
        return any(w.kind is PoolKind.PREFILL for w in self.workers.values())

    async def close(self) -> None:
        """Stop listening to the workers (the deployment is shutting down)."""
        await self._background.close()

    async def drain(self, grace_s: float) -> bool:
        """Admit nothing more; wait up to `grace_s` for the requests in flight. True if all finished."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.requests

    def apply_report(self, worker: Worker, report: LoadReport) -> None:
        if self._fold_report(worker, report) == "behind" and (worker.cache_read is None or worker.cache_read.done()):
            worker.cache_read = self._background.spawn(self._read_cache_changes(worker))

    def _fold_report(self, worker: Worker, report: LoadReport) -> str | None:
        """Take a report's load and cache changes; the cache outcome (`PrefixIndex.apply_changes`), None when
        the report says nothing of the cache."""
        worker.apply(report)
        self.observer.on_report(worker, report)
        self._room.set()
        return self._apply_cache_changes(worker, report) if report.seq is not None else None

    def cache_cursor(self, worker: Worker) -> int:
        """Where the next read of the worker's prefix-cache changes starts (`PoolManager`'s reports)."""
        return self.index.cursor(worker.worker_id)

    def _apply_cache_changes(self, worker: Worker, report: LoadReport) -> str:
        """Fold a worker's prefix-cache changes into the index, in order and exactly once.

        NOTE: decode workers' caches too: a prompt whose prefix a decode worker holds may prefill there.
        Each router replica reads every worker's numbered change log from its own cursor
        (`PrefixIndex.apply_changes`). A prefill's answer carries the changes after the cursor the router had
        when it asked, so the prompt's blocks are in the index before the client's next request. A report that
        does not start at the cursor (other reports moved it meanwhile; a report that only says how far the
        log has got) makes the router read again from the cursor, and a reader the log could no longer serve
        gets the whole cache (a resync)."""
        had = self.index.cursor(worker.worker_id) >= 0
        outcome = self.index.apply_changes(worker.worker_id, report)
        if outcome == "resynced" and had:
            self.observer.on_cache_resync(worker)
        return outcome

    async def _read_cache_changes(self, worker: Worker) -> None:
        for _ in range(3):  # another report may move the cursor meanwhile: read again from where it is now
            try:
                report = await worker.client.report(self.index.cursor(worker.worker_id),
                                                    self.config.call_timeout_s)
            except WorkerError as e:
                if e.lost:
                    self.registry.lose(worker, e.reason)
                return  # the next periodic report reads them
            if not worker.alive or self._fold_report(worker, report) != "behind":
                return

    # -- workers joining and leaving --------------------------------------------------------------------

    def _on_worker_added(self, worker: Worker) -> None:
        if worker.info.kv_bytes_per_token:
            self.cost.bytes_per_token = worker.info.kv_bytes_per_token
        if worker.kind.decodes:
            self._background.spawn(self._consume_steps(worker))
        self._room.set()

    def _on_worker_lost(self, worker: Worker, why: str) -> None:
        """Never place on it again; the attempts that depend on it now fail (and migrate)."""
        self.index.remove_worker(worker.worker_id)
        self.cost.forget(worker.worker_id)
        self.observer.on_worker_lost(worker)
        notice = WorkerLostNotice(worker.worker_id, why)
        for att in list(self._attempts.values()):
            # NOTE: a prefill worker's loss matters only while the attempt is prefilling on it: a request
            # already decoding elsewhere holds nothing there.
            if att.decode is worker and att.reservation is None and att.promised and att.prefill is not worker:
                # NOTE: chosen for a prompt whose blocks are reserved later, it holds nothing for it yet: the
                # prompt will be given another decode worker when it asks (`_reserve_late`)
                self._unpromise(att)
                att.decode = None
                continue
            if att.decode is worker or (att.prefill is worker and att.phase <= Phase.PREFILLING):
                att.worker_lost(notice)
        self._room.set()

    def on_heartbeat(self, worker: Worker) -> None:
        """A prefill worker is alive and moving: renew the decode leases of the prompts it is computing."""
        if worker.kind is not PoolKind.PREFILL:
            return
        by_decode: dict[str, list[str]] = defaultdict(list)
        for att in self._attempts.values():
            if (att.prefill is worker and att.phase is Phase.PREFILLING and att.reservation is not None
                    and att.decode is not None and att.decode.alive):
                by_decode[att.decode.worker_id].append(att.key)
        for wid, keys in by_decode.items():
            self._background.spawn(self._renew(self.workers[wid], keys))

    async def _renew(self, decode: Worker, keys: list[str]) -> None:
        try:
            gone = await decode.client.renew(keys, self.config.call_timeout_s)
        except WorkerError as e:
            logger.warning("lease renewal on %s failed: %s", decode.worker_id, e)
            return
        if gone:
            logger.warning("reservations %s on %s lapsed before their prefill finished", gone, decode.worker_id)

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
                if att.moved_from is not None:
                    path = self._decode(state, att, att.decode)
                else:
                    path = (self._disaggregated if self.disaggregated else self._colocated)(state, att)
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
                        moved = await self._move_kv(state, att)
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
                    raise RouterError("UNAVAILABLE", f"request {state.client_id!r} failed {len(state.failures)} "
                                      f"times (--migration-limit {self.config.migration_limit}): "
                                      + "; ".join(str(f) for f in state.failures)) from e
                state.to(Phase.QUEUED)
            finally:
                self._end_attempt(att, clean)

    def _end_attempt(self, att: Attempt, clean: bool) -> None:
        """The attempt is over: route nothing more to it, and free what its workers may hold for it."""
        del self._attempts[att.key]
        self._unpromise(att)
        if clean:
            return  # the workers ended it themselves (finished), and the reservation was released
        for worker in {att.prefill, att.decode} - {None}:
            if worker.alive:
                self._abort_soon(worker, att.key)
        self._room.set()

    async def _colocated(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        choice = await self._choose_prefill(att)
        worker = self.workers[choice.worker_id]
        # the prompt and its first token must fit one worker's cache (else every attempt would fail alike)
        self._check_fits(cdiv(len(att.prompt) + 1, self.block_size), [worker], "colocated")
        att.prefill = att.decode = worker
        async with contextlib.aclosing(self._local(state, att)) as events:
            async for event in events:
                yield event

    async def _local(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        """One worker prefills and decodes the attempt: a colocated worker, or a decode worker given a prompt
        short enough to prefill itself (no prefill queue, no KV transfer)."""
        worker = att.decode
        state.to(Phase.PREFILLING)
        first_attempt = not state.generated
        if first_attempt:
            state.pool = worker.kind.value
            state.placement = "local" if worker.kind is PoolKind.DECODE else "colocated"
        state.prefill_worker = state.decode_worker = worker.worker_id
        try:
            await worker.client.submit(att.key, att.prompt, att.params, self.config.call_timeout_s)
        except WorkerError as e:
            raise self._call_failed(worker, e, Cause.DECODE_LOST) from e
        while True:
            delta = await self._next_delta(att, worker)
            if state.phase is Phase.PREFILLING:
                # NOTE: the cost model learns this worker's prefill rate from its step stream, where it can
                # tell the prompt's chunks from the decode steps they rode (`_consume_steps`)
                if first_attempt:
                    state.timing.queue = time.time() - state.arrival  # the engine queues and prefills in one
                    state.num_cached_tokens = delta.num_cached_tokens
                state.to(Phase.DECODING)
            att.num_output += len(delta.token_ids)
            yield RouterEvent(list(delta.token_ids), delta.finish_reason, first=not state.generated)
            if delta.finish_reason is not None:
                return
            self._check_move(att)

    async def _disaggregated(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        path = await self._place(att)
        self.observer.on_placement(path.value)
        inner = self._local(state, att) if path is Path.LOCAL else self._remote(state, att)
        async with contextlib.aclosing(inner) as events:
            async for event in events:
                yield event

    async def _remote(self, state: RequestState, att: Attempt) -> AsyncIterator[RouterEvent]:
        """The prefill worker computes the prompt and ships its KV to the decode worker reserved for it
        (`_place` chose both and counted the prompt in the prefill worker's queue)."""
        prefill, decode = att.prefill, att.decode
        queued = att.prefill_tokens  # of the prompt's tokens counted in the prefill worker's queue
        first = not state.generated
        first_out: float | None = None
        result: PrefillResult | None = None
        try:
            state.to(Phase.PREFILLING)
            async with contextlib.aclosing(self._prefill(att, prefill)) as items:
                async for item in items:
                    if isinstance(item, PrefillResult):
                        result = item
                        continue
                    if isinstance(item, DestinationWanted):
                        # NOTE: all but its last horizon of tokens are computed: a prompt held for decode room
                        # must not make its prefill worker look busy to placement meanwhile
                        left = min(queued, prefill.info.destination_horizon_tokens)
                        prefill.inflight_prefill_tokens -= queued - left
                        queued = left
                        decode = await self._reserve_late(att, prefill)
                        continue
                    prefill.inflight_prefill_tokens -= queued
                    queued = 0
                    self.cost.observe_prefill(prefill.worker_id, len(att.prompt) - item.num_cached_tokens,
                                              item.compute_s or item.sampled_at - item.scheduled_at)
                    if first:
                        t = state.timing
                        t.queue, t.prefill = item.scheduled_at - state.arrival, item.sampled_at - item.scheduled_at
                        state.pool = PoolKind.PREFILL.value
                        state.placement = "remote"
                        state.num_cached_tokens = item.num_cached_tokens
                    state.prefill_worker, state.decode_worker = prefill.worker_id, decode.worker_id
                    att.num_output = 1
                    if item.finish_reason is not None:  # the first token ends it: free both sides
                        for worker in (decode, prefill):
                            self._abort_soon(worker, att.key)
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
                        raise self._call_failed(decode, e, Cause.DECODE_LOST) from e
                    if not started:
                        raise AttemptFailed(Cause.RESERVATION, decode.worker_id,
                                            "the reservation lapsed before decoding")
        finally:
            prefill.inflight_prefill_tokens -= queued
        if result is None:
            raise AttemptFailed(Cause.WORKER_ERROR, prefill.worker_id, "the prefill stream ended without an outcome")
        if result.report is not None and prefill.alive:
            self.apply_report(prefill, result.report)
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
        if first:
            state.timing.kv_transfer = result.kv_done_at - result.sampled_at
        state.to(Phase.DECODING)
        self._check_move(att)
        async with contextlib.aclosing(self._decode(state, att, decode, first_out if first else None)) as events:
            async for event in events:
                yield event

    async def _decode(self, state: RequestState, att: Attempt, decode: Worker,
                      first_out: float | None = None) -> AsyncIterator[RouterEvent]:
        """The decoding attempt's tokens, from its decode worker's step stream, until it finishes.
        `first_out`: when the request's first token went out, to time its first decode step."""
        while True:
            delta = await self._next_delta(att, decode)
            if first_out is not None and delta.token_ids:
                state.timing.decode_admit = time.time() - first_out
                first_out = None
            att.num_output += len(delta.token_ids)
            yield RouterEvent(list(delta.token_ids), delta.finish_reason)
            if delta.finish_reason is not None:
                return
            self._check_move(att)

    @staticmethod
    def _check_move(att: Attempt) -> None:
        """A drained attempt ends once the client has every token its decode worker produced for it."""
        if att.move is not None and att.num_output >= att.move.num_tokens:
            raise AttemptFailed(Cause.DRAIN, att.move.worker_id, f"drained ({att.move.method.value} move)")

    async def _prefill(self, att: Attempt, prefill: Worker
                       ) -> AsyncIterator[DestinationWanted | FirstToken | PrefillResult]:
        """The prefill stream's items (the first token, then the outcome), abandoned as soon as either of the
        attempt's workers is lost."""
        items = aiter(prefill.client.prefill(att.key, att.prompt, att.params, att.reservation,
                                             self.index.cursor(prefill.worker_id)))
        lost = asyncio.ensure_future(att.lost.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(anext(items))
                await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                while not nxt.done() and not att.lost.is_set():
                    # NOTE: a loss that was forgotten while this stream was suspended (`_reserve_late` found the
                    # decode worker it tried lost and reserved on another): wait on
                    lost = asyncio.ensure_future(att.lost.wait())
                    await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    n = att.lost_notice
                    cause = Cause.PREFILL_LOST if n.worker_id == prefill.worker_id else Cause.DECODE_LOST
                    raise AttemptFailed(cause, n.worker_id, n.reason)
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                except WorkerError as e:
                    raise self._call_failed(prefill, e, Cause.PREFILL_LOST) from e
                yield item
        finally:
            lost.cancel()
            with contextlib.suppress(Exception):
                await items.aclose()

    # -- placement and admission ------------------------------------------------------------------------

    async def _place(self, att: Attempt) -> Path:
        """Choose where the attempt prefills and decodes, and hold what it needs there: the prefill worker
        (its queue counts the prompt from here) and a reservation on the decode worker, or, on the local
        path, just the decode worker (which prefills the prompt itself)."""
        if self.config.placement == "separate":  # prefill worker first, then a decode worker for it
            choice = await self._choose_prefill(att)
            prefill = self._take_prefill(att, self.workers[choice.worker_id], choice.cached_blocks)
            try:
                att.decode, att.reservation = await self._reserve(att, prefill)
            except BaseException:
                prefill.inflight_prefill_tokens -= att.prefill_tokens
                raise
            return Path.REMOTE
        return await self._place_jointly(att)

    def _take_prefill(self, att: Attempt, prefill: Worker, cached_blocks: int) -> Worker:
        att.prefill = prefill
        # NOTE: counted from the moment of choice, so a burst of requests placed together spreads out
        att.prefill_tokens = len(att.prompt) - cached_blocks * self.block_size
        prefill.inflight_prefill_tokens += att.prefill_tokens
        return prefill

    async def _place_jointly(self, att: Attempt) -> Path:
        """The cheapest (prefill, decode) pair, or the decode worker alone, by the cost model
        (`placement.choose_path`), trying the next option when a decode worker turns out to be full, and
        waiting in the admission queue when none has room."""
        n, bs = len(att.prompt), self.block_size
        need = cdiv(n, bs)
        hashes = hash_blocks(att.prompt, bs)
        deadline = att.created + self.config.admission_timeout_s
        while True:
            prefills = self.registry.schedulable(PoolKind.PREFILL)
            decoders = self.registry.schedulable(PoolKind.DECODE)
            if not prefills or not decoders:
                missing = "prefill" if not prefills else "decode"
                await self._wait_room(deadline, "UNAVAILABLE", f"no live {missing} worker: the {missing} pool is "
                                      "being replaced; check its workers' logs")
                continue
            self._check_fits(need, decoders, "decode")
            limit = self.config.max_queued_prefill_tokens
            open_ = [ld for ld in (w.snapshot() for w in prefills)
                     if ld.queued_prefill_tokens == 0 or ld.queued_prefill_tokens + n <= limit]
            options = choose_path(hashes, n, bs, open_, [w.snapshot() for w in decoders], self.index, self.cost,
                                  need, local=self.config.local_prefill,
                                  local_chunk_tokens=self.config.local_chunk_tokens)
            if not open_ and not options:
                raise RouterError("RESOURCE_EXHAUSTED", f"every prefill worker has more than {limit} prompt "
                                  "tokens queued (--max-queued-prefill-tokens); retry later")
            full: set[str] = set()
            for opt in options:
                if opt.decode in full:
                    continue
                decode = att.decode = self.workers[opt.decode]
                if opt.path is Path.LOCAL:
                    # NOTE: counted from the moment of choice until its next report, so a burst spreads out
                    decode.load = dataclasses.replace(decode.load, num_running=decode.load.num_running + 1,
                                                      free_blocks=max(0, decode.load.free_blocks - need))
                    att.prefill = decode
                    return Path.LOCAL
                prefill = self._take_prefill(att, self.workers[opt.prefill], opt.prefill_cached_blocks)
                if self._may_defer(att, prefill, decode, need):
                    self._promise(att, decode, need)
                    return Path.REMOTE
                try:
                    att.reservation = await self._try_reserve(att, decode, prefill, need)
                finally:
                    if att.reservation is None:
                        prefill.inflight_prefill_tokens -= att.prefill_tokens
                if att.reservation is not None:
                    return Path.REMOTE
                full.add(decode.worker_id)
                att.forget_placement()
            await self._queue_for_room(need, deadline)

    async def _choose_prefill(self, att: Attempt) -> PrefillChoice:
        """A live prefill (or colocated) worker for the attempt's prompt, waiting for one while none is alive."""
        kind = PoolKind.PREFILL if self.disaggregated else PoolKind.COLOCATED
        ids = att.prompt
        hashes = hash_blocks(ids, self.block_size)
        deadline = att.created + self.config.admission_timeout_s
        while True:
            live = self.registry.schedulable(kind)
            if live:
                limit = self.config.max_queued_prefill_tokens
                loads = [w.snapshot() for w in live]
                open_ = [ld for ld in loads if ld.queued_prefill_tokens == 0
                         or ld.queued_prefill_tokens + len(ids) <= limit]
                if not open_:
                    raise RouterError("RESOURCE_EXHAUSTED", f"every {kind.value} worker has more than "
                                      f"{limit} prompt tokens queued (--max-queued-prefill-tokens); retry later")
                choice = self.choose_prefill(hashes, open_, self.index, self.block_size, len(ids))
                assert choice is not None
                return choice
            await self._wait_room(deadline, "UNAVAILABLE", f"no live {kind.value} worker: the {kind.value} pool "
                                  "is being replaced; check its workers' logs")

    async def _reserve(self, att: Attempt, prefill: Worker) -> tuple[Worker, Reservation]:
        """A decode worker with room for the prompt's blocks, waiting in the admission queue if none has."""
        need = cdiv(len(att.prompt), self.block_size)
        deadline = att.created + self.config.admission_timeout_s
        while True:
            decoders = self.registry.schedulable(PoolKind.DECODE)
            if not decoders:
                await self._wait_room(deadline, "UNAVAILABLE", "no live decode worker: the decode pool is being "
                                      "replaced")
                continue
            self._check_fits(need, decoders, "decode")
            tried: set[str] = set()
            while True:
                if not prefill.alive:  # lost while this request waited for room: place it again
                    raise AttemptFailed(Cause.PREFILL_LOST, prefill.worker_id, "lost before its prefill began")
                loads = [w.snapshot() for w in decoders if w.worker_id not in tried and w.alive]
                wid = choose_decode(prefill.info.node_id, need, loads)
                if wid is None:
                    break
                tried.add(wid)
                # NOTE: named before the call, so a cancel or timeout mid-call still aborts what it reserved
                decode = att.decode = self.workers[wid]
                reservation = await self._try_reserve(att, decode, prefill, need)
                if reservation is not None:
                    return decode, reservation
                att.forget_decode()
            # NOTE: a prompt waiting for decode room is not in the prefill worker's queue: don't count it there
            prefill.inflight_prefill_tokens -= att.prefill_tokens
            try:
                await self._queue_for_room(need, deadline)
            finally:
                prefill.inflight_prefill_tokens += att.prefill_tokens

    async def _try_reserve(self, att: Attempt, decode: Worker, prefill: Worker, need: int) -> Reservation | None:
        """Reserve the attempt's `need` blocks on `decode` for a prefill on `prefill`. None when the worker is
        full, the call failed, or either worker was lost meanwhile: whatever it may have reserved is given back."""
        # NOTE: counted from the moment of choice until the worker's next report, so a burst of requests placed
        # together spreads over the pool (a new worker takes its share at once)
        decode.load = dataclasses.replace(decode.load, num_running=decode.load.num_running + 1,
                                          free_blocks=max(0, decode.load.free_blocks - need))
        try:
            reservation = await decode.client.reserve(att.key, att.prompt, att.params, prefill.worker_id,
                                                      self.config.call_timeout_s)
        except WorkerError as e:
            self._call_failed(decode, e, Cause.DECODE_LOST)
            self._abort_soon(decode, att.key)  # it may have reserved before timing out
            logger.warning("reserve on %s failed: %s", decode.worker_id, e)
            return None
        if reservation is not None and decode.alive and prefill.alive:
            return reservation
        if reservation is not None:  # one of the two was lost during the call
            self._abort_soon(decode, att.key)
        else:
            decode.load = dataclasses.replace(decode.load, free_blocks=0)  # until its next report
        return None

    # -- late reservation -------------------------------------------------------------------------------

    def _may_defer(self, att: Attempt, prefill: Worker, decode: Worker, need: int) -> bool:
        """Whether the attempt's decode blocks may be reserved later, when its prefill worker nears the last
        chunk: the prompt is longer than that worker's horizon (a shorter one would ask at once), and `decode`
        has not been promised more than its whole cache in such prompts (its `promise_share` of it with router
        replicas).

        NOTE: this overcommits on purpose. The blocks a prompt would hold while it queues and computes on a
        prefill worker serve decoding sequences meanwhile, betting that the decode worker has room again by
        the time the prompt is due (measured idle: a third of a decode worker's used blocks under a burst,
        `benchmarks/kv_reserved_probe.py`). The cap bounds the bet: at most one cache's worth of prompts can
        find no room when due, and those wait for it (`_reserve_late`) with their KV held on the prefill
        worker."""
        horizon = prefill.info.destination_horizon_tokens
        return (self.config.late_reservation and horizon is not None and att.prefill_tokens > horizon
                and decode.promised_blocks + need <= self.config.promise_share * decode.load.total_blocks)

    def _promise(self, att: Attempt, decode: Worker, need: int) -> None:
        att.promised = need
        decode.promised_blocks += need
        # NOTE: counted from the moment of choice until the worker's next report, as a reservation is
        decode.load = dataclasses.replace(decode.load, num_running=decode.load.num_running + 1,
                                          free_blocks=max(0, decode.load.free_blocks - need))

    def _unpromise(self, att: Attempt) -> None:
        if att.promised and att.decode is not None:
            att.decode.promised_blocks -= att.promised
        att.promised = 0

    async def _reserve_late(self, att: Attempt, prefill: Worker) -> Worker:
        """The prefill worker nears the last chunk of a prompt sent without its decode blocks: reserve them,
        on the decode worker chosen at placement if it still has room, else on another (by node and free
        blocks), waiting for room while there is none, and hand them to the prefill worker. Returns the decode
        worker that holds them.

        Waiting here is not the admission queue: the request was admitted and its prompt mostly computed;
        it fails only after `admission_timeout_s` with no decode room at all: RESOURCE_EXHAUSTED, or UNAVAILABLE
        when no decode worker is alive."""
        need = cdiv(len(att.prompt), self.block_size)
        deadline = time.time() + self.config.admission_timeout_s
        preferred = att.decode
        self._unpromise(att)
        tried: set[str] = set()
        while att.reservation is None:
            if not prefill.alive:
                raise AttemptFailed(Cause.PREFILL_LOST, prefill.worker_id, "lost before its last chunk")
            live = [w for w in self.registry.schedulable(PoolKind.DECODE) if w.alive and w.worker_id not in tried]
            if preferred in live:
                wid = preferred.worker_id
            else:
                wid = choose_decode(prefill.info.node_id, need, [w.snapshot() for w in live])
            if wid is None:
                tried.clear()
                if not self.registry.schedulable(PoolKind.DECODE):
                    await self._wait_room(deadline, "UNAVAILABLE", "no live decode worker for a prompt nearing "
                                          "the end of its prefill: the decode pool is being replaced")
                    continue
                await self._wait_room(deadline, "RESOURCE_EXHAUSTED", f"no decode worker had room for {need} KV "
                                      f"blocks within {self.config.admission_timeout_s:.0f}s of the prompt's "
                                      "prefill nearing its end; the decode pool is overloaded, retry later")
                continue
            tried.add(wid)
            decode = att.decode = self.workers[wid]
            att.reservation = await self._try_reserve(att, decode, prefill, need)
            if att.reservation is None:
                att.forget_decode()
        try:
            ok = await prefill.client.set_destination(att.key, att.reservation, self.config.call_timeout_s)
        except WorkerError as e:
            raise self._call_failed(prefill, e, Cause.PREFILL_LOST) from e
        if not ok:
            raise AttemptFailed(Cause.WORKER_ERROR, prefill.worker_id, "the prompt left its prefill worker before "
                                "its decode blocks were set")
        return att.decode

    async def _queue_for_room(self, need: int, deadline: float) -> None:
        """Wait in the bounded admission queue until blocks may have been freed; RESOURCE_EXHAUSTED at once when
        the queue is full, or past `deadline`."""
        if self.num_queued >= self.config.max_queue:
            raise RouterError("RESOURCE_EXHAUSTED", f"no decode worker has room for {need} KV blocks and "
                              f"the admission queue is full ({self.config.max_queue} waiting); retry later")
        self.num_queued += 1
        try:
            await self._wait_room(deadline, "RESOURCE_EXHAUSTED", f"no decode worker had room for {need} KV "
                                  f"blocks within {self.config.admission_timeout_s:.0f}s; retry later")
        finally:
            self.num_queued -= 1

    @staticmethod
    def _check_fits(need: int, workers: list[Worker], pool: str) -> None:
        """A prompt larger than any worker's whole KV cache can never be served: refuse it, not retry it."""
        largest = max(w.load.total_blocks for w in workers)
        if need > largest:
            raise RouterError("INVALID_ARGUMENT", f"prompt: needs {need} KV blocks but the largest {pool} worker "
                              f"holds {largest}; shorten the prompt or give the workers more KV memory")

    async def _wait_room(self, deadline: float, code: str, why: str) -> None:
        """Wait until something may have changed (blocks freed, a worker joined); past `deadline`, fail with
        `code` (a gRPC status name) and `why`."""
        remaining = deadline - time.time()
        if remaining <= 0:
            raise RouterError(code, why)
        self._room.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout=min(remaining, 0.5))

    # -- worker streams ---------------------------------------------------------------------------------

    async def _consume_steps(self, worker: Worker) -> None:
        """Fan one decode worker's per-step messages out to its attempts, for as long as it lives."""
        last = None  # the previous step's output: back-to-back steps time the worker's decode step
        try:
            async for out in worker.client.steps():
                if out.step is not None and last is not None and last.step is not None and out.step == last.step + 1 and out.stats is not None:
                    st = out.stats
                    self.cost.observe_step(worker.worker_id, out.time - last.time, st.num_decode_seqs,
                                           st.num_prefill_tokens)
                last = out if out.step is not None else last
                if out.load is not None:
                    self.apply_report(worker, LoadReport(worker.worker_id, out.load))
                for delta in out.deltas:
                    att = self._attempts.get(delta.request_id)
                    if att is None:
                        continue
                    att.queue.put_nowait(delta)
                    if not att.want_paused and att.queue.qsize() >= self.config.max_buffered_steps:
                        self._set_flow(worker, att, paused=True)
            why = "its step stream ended"
        except WorkerError as e:
            why = e.reason
        except Exception as e:  # noqa: BLE001 - whatever broke the stream, the worker cannot be trusted
            why = f"its step stream failed: {e!r}"
        # NOTE: even a transient interruption (ActorUnavailableError) ends the worker: tokens in flight on the
        # broken stream may be gone, and migrating its sequences is exact where resubscribing is not
        self.registry.lose(worker, why)

    async def _next_delta(self, att: Attempt, worker: Worker) -> TokenDelta:
        """The attempt's next tokens: what one step produced, or, when the stream is behind (a slow client, a
        busy router), every step already waiting merged into one, so one message carries them all.

        NOTE: merging only takes what is already queued: it never waits, so it adds no latency; it cuts the
        per-message cost (the gRPC write, the detokenizer call, the metrics hook) exactly when it matters."""
        item = await self._take(att, worker)
        if item.finish_reason is None and att.held is None and not att.queue.empty():
            tokens = list(item.token_ids)
            while item.finish_reason is None and not att.queue.empty():
                nxt = att.queue.get_nowait()
                if isinstance(nxt, Notice) or (nxt.finish_reason is not None and nxt.finish_reason.is_failure):
                    att.held = nxt  # handled on the next call, after these tokens
                    break
                tokens += nxt.token_ids
                item = TokenDelta(item.request_id, tokens, nxt.finish_reason, item.num_cached_tokens)
        if att.want_paused and att.queue.qsize() <= self.config.max_buffered_steps // 4:
            self._set_flow(worker, att, paused=False)
        if item.finish_reason is not None:
            self._room.set()
        return item

    async def _take(self, att: Attempt, worker: Worker) -> TokenDelta:
        while True:
            item, att.held = (att.held, None) if att.held is not None else (await att.queue.get(), None)
            if isinstance(item, TokenDelta):
                break
            if isinstance(item, MoveNotice):
                att.move = item
                self._check_move(att)  # else tokens it produced before the hold are still on their way
            elif item.worker_id == worker.worker_id:
                raise AttemptFailed(Cause.DECODE_LOST, item.worker_id, item.reason)
            # NOTE: the prefill worker was lost after its answer: the decoding attempt does not need it
        if item.finish_reason is not None and item.finish_reason.is_failure:
            raise AttemptFailed(Cause.WORKER_ERROR, worker.worker_id,
                                item.error or f"the worker ended the sequence ({item.finish_reason.value})")
        return item

    def _set_flow(self, worker: Worker, att: Attempt, paused: bool) -> None:
        att.want_paused = paused
        if att.flow_task is None or att.flow_task.done():
            att.flow_task = self._background.spawn(self._flow(worker, att))

    async def _flow(self, worker: Worker, att: Attempt) -> None:
        """Bring the decode worker to the attempt's wanted pause state (backpressure from a slow client),
        one call at a time, so a resume never overtakes its pause, retrying what fails until it holds, the
        attempt ends or the worker is lost (a lost pause would leave the stream stuck forever)."""
        while att.key in self._attempts and worker.alive and att.applied_paused != att.want_paused:
            want = att.want_paused
            try:
                await (worker.client.pause if want else worker.client.resume)(att.key, self.config.call_timeout_s)
                att.applied_paused = want
            except WorkerError as e:
                self._call_failed(worker, e, Cause.WORKER_ERROR)
                logger.warning("%s of %s on %s failed, retrying: %s", "pause" if want else "resume", att.key,
                               worker.worker_id, e)
                await asyncio.sleep(0.1)

    def _call_failed(self, worker: Worker, e: WorkerError, cause: Cause) -> AttemptFailed:
        """A call to `worker` failed: if it found the worker dead, lose it now (before liveness would)."""
        if e.lost:
            self.registry.lose(worker, e.reason)
        elif e.failure is Failure.ERROR:  # the worker raised: it lives, the call failed
            cause = Cause.WORKER_ERROR
        return AttemptFailed(cause, worker.worker_id, e.reason)

    def _abort_soon(self, worker: Worker, key: str) -> None:
        """Tell `worker` to free what it holds for `key`, in the background (a drain waits for these)."""
        task = self._background.spawn(self._abort(worker, key))
        pending = self._aborts.setdefault(worker.worker_id, set())
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def _abort(self, worker: Worker, key: str) -> None:
        if not worker.alive:
            return
        try:
            await worker.client.abort(key, self.config.call_timeout_s)
        except WorkerError as e:  # best effort: a dead worker holds nothing, a stuck one is declared dead
            self._call_failed(worker, e, Cause.WORKER_ERROR)
            logger.warning("abort of %s on %s failed: %s", key, worker.worker_id, e)
        self._room.set()

    # -- draining ---------------------------------------------------------------------------------------

    def holds_work(self, worker: Worker) -> bool:
        """Whether any attempt still depends on `worker` (prefilling on it, or reserved or decoding there; a
        prompt only promised to it holds nothing there, and is reserved elsewhere when due: it is not
        schedulable any more)."""
        return any((att.decode is worker and not (att.reservation is None and att.promised))
                   or (att.prefill is worker and att.phase <= Phase.PREFILLING)
                   for att in self._attempts.values())

    async def drain_worker(self, worker: Worker, method: Method = Method.KV, timeout_s: float = 300.0) -> bool:
        """Stop placing on `worker` and wait until nothing depends on it: prompts it prefills finish; each
        sequence it decodes moves to another decode worker (with its KV, `method` KV; else by recompute) as
        soon as one can take it. True once it holds nothing; False past `timeout_s` (what is left then fails
        over like a lost worker's when the caller retires it)."""
        worker.draining = True
        self._room.set()
        if not worker.kind.decodes or (worker.kind is PoolKind.COLOCATED and method is Method.KV):
            method = Method.RECOMPUTE  # colocated workers have no KV transport: their sequences recompute
        deadline = time.monotonic() + timeout_s
        logger.info("draining %s (%s moves)", worker.worker_id, method.value)
        warmed: set[str] = set()
        while worker.alive and self.holds_work(worker):
            if time.monotonic() > deadline:
                return False
            if self.registry.schedulable(worker.kind):  # somewhere to go (a rolling restart's new worker)
                if method is Method.KV:
                    await self._warm_links(worker, warmed)
                for att in list(self._attempts.values()):
                    if att.decode is worker and att.phase is Phase.DECODING and not att.moving:
                        att.moving = True
                        self._background.spawn(self._hold(att, worker, method))
            await asyncio.sleep(0.05)
        # NOTE: the attempts that left it sent their aborts in the background: it holds nothing once answered
        await asyncio.gather(*self._aborts.get(worker.worker_id, ()), return_exceptions=True)
        return worker.alive

    async def _warm_links(self, worker: Worker, warmed: set[str]) -> None:
        """Have a drained decode worker open its KV links to the others before anything moves (best effort:
        a move opens its link itself when this fails)."""
        peers = [w for w in self.registry.schedulable(PoolKind.DECODE) if w.worker_id not in warmed]
        if not peers:
            return
        warmed.update(w.worker_id for w in peers)
        try:
            await worker.client.connect([w.info.kv_address for w in peers], self.config.call_timeout_s)
        except WorkerError as e:
            logger.warning("%s could not open KV links ahead of its moves: %s", worker.worker_id, e)

    async def _hold(self, att: Attempt, worker: Worker, method: Method) -> None:
        """Hold a drained worker's sequence, then tell its attempt how many tokens to deliver before moving."""
        try:
            num_tokens = await worker.client.hold(att.key, self.config.call_timeout_s)
        except WorkerError as e:
            self._call_failed(worker, e, Cause.WORKER_ERROR)
            logger.warning("hold of %s on %s failed: %s", att.key, worker.worker_id, e)
            num_tokens = None
        if num_tokens is None:  # not decoding right now (preempted, finishing): the drain tries it again
            await asyncio.sleep(0.1)
            att.moving = False
            return
        att.queue.put_nowait(MoveNotice(worker.worker_id, num_tokens, method))

    async def _move_kv(self, state: RequestState, att: Attempt) -> Attempt | None:
        """Move a held sequence's KV from its (drained) decode worker to another; the new attempt, already
        DECODING there, or None when the move could not happen (the request then recomputes)."""
        src = att.decode
        new = state.new_attempt(kv_move=True)
        self._attempts[new.key] = new
        timeout = self.config.kv_move_timeout_s
        moved = False
        try:
            need = cdiv(len(new.prompt), self.block_size)
            loads = [w.snapshot() for w in self.registry.schedulable(PoolKind.DECODE) if w is not src]
            wid = choose_decode(src.info.node_id, need, loads)
            if wid is None:
                logger.warning("no decode worker has room for %s's %d blocks: it recomputes", state.id, need)
                return None
            dst = new.decode = self.workers[wid]
            try:
                async with asyncio.timeout(timeout):
                    new.reservation = await dst.client.reserve(new.key, new.prompt, new.params, src.worker_id,
                                                               timeout)
                    if new.reservation is None:
                        return None
                    result = await src.client.send_kv(att.key, new.key, new.reservation, timeout)
                    self.observer.on_kv_move(src.worker_id, dst.worker_id, result)
                    move = KVMove(state.id, src.worker_id, dst.worker_id, len(new.prompt), result)
                    try:
                        if not result.ok:
                            logger.warning("KV move of %s from %s to %s failed: %s", state.id, src.worker_id,
                                           dst.worker_id, result.error)
                            return None
                        if not await dst.client.start(new.key, state.generated[-1], timeout):
                            return None
                        if self.config.verify_kv_moves:
                            move = dataclasses.replace(
                                move, src_digest=await src.client.kv_digest(att.key, len(new.prompt), timeout),
                                dst_digest=await dst.client.kv_digest(new.key, len(new.prompt), timeout))
                            if move.src_digest != move.dst_digest:
                                logger.error("KV move of %s from %s to %s: the KV differs from its source",
                                             state.id, src.worker_id, dst.worker_id)
                                return None
                    finally:
                        self.kv_moves.append(move)  # every move that sent its KV, whatever came of it
            except (WorkerError, TimeoutError) as e:
                if isinstance(e, WorkerError):
                    self._call_failed(self.workers[e.worker_id], e, Cause.WORKER_ERROR)
                logger.warning("KV move of %s from %s failed: %s", state.id, src.worker_id, e or "timed out")
                return None
            new.num_output = 1  # the last streamed token: the new attempt's first, already out
            new.moved_from = src
            state.decode_worker = dst.worker_id
            moved = True
            return new
        finally:
            if not moved:
                self._end_attempt(new, clean=False)
