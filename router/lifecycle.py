"""One request's life in the router: an ordered phase enum, its legal moves, and its attempts.

    QUEUED ──► PREFILLING ──► DECODING ──► FINISHED
      ▲            │             ▲  │
      │            ▼      KV move│  ▼
      └──────── MIGRATING ◄──────┴──┘         (any live phase) ──► FAILED | CANCELLED

A request is served by one or more *attempts*. Each attempt has its own key (`<request id>.<n>`), the only
id any worker ever sees, so nothing of an earlier attempt (late tokens, an abort, a lapsed reservation) can
touch a later one, and two client requests never share state in a worker even when they carry the same
client `request_id`. An attempt that fails (a worker lost, a KV transfer failed, a reservation lapsed)
moves the request to MIGRATING; the router then places it again with prompt + the tokens already streamed
as the new prompt, so the client's stream goes on with no duplicate and no missing token.

A drained decode worker's sequences migrate without a failure: each is held there, its KV shipped to another
decode worker, and a new attempt goes straight back to DECODING there (`Attempt.moved_from`); if the move
fails, the request is placed again by recompute, like a failure, without counting against the limit.

NOTE: on the disaggregated path PREFILLING covers the KV transfer too: the prefill worker pushes each
layer's KV while the next computes, and answers once both are done, so the router sees no edge between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from protocol.kinds import Cause, Method, Path, PoolKind
from protocol.messages import Reservation, TokenDelta
from router.validation import ValidatedRequest

if TYPE_CHECKING:
    from router.registry import Worker


class Phase(enum.IntEnum):
    QUEUED = enum.auto()  # waiting for placement: a live worker, KV room, admission
    PREFILLING = enum.auto()  # on a prefill worker (or colocated engine), KV on its way to the decode worker
    DECODING = enum.auto()  # the first token is out; the decode worker streams the rest
    MIGRATING = enum.auto()  # an attempt failed; about to be placed again
    FINISHED = enum.auto()  # stop or length: the client got every token
    FAILED = enum.auto()  # ended with an error status
    CANCELLED = enum.auto()  # the client went away

    @property
    def is_finished(self) -> bool:
        return self >= Phase.FINISHED


_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.PREFILLING, Phase.MIGRATING}),
    Phase.PREFILLING: frozenset({Phase.DECODING, Phase.MIGRATING, Phase.FINISHED}),
    Phase.DECODING: frozenset({Phase.MIGRATING, Phase.FINISHED}),
    Phase.MIGRATING: frozenset({Phase.QUEUED, Phase.DECODING}),  # DECODING: its KV moved
}
_ENDS = frozenset({Phase.FAILED, Phase.CANCELLED})  # reachable from every phase that is not final


class AttemptFailed(Exception):
    def __init__(self, cause: Cause, worker_id: str, reason: str) -> None:
        super().__init__(f"{cause.value} on {worker_id}: {reason}")
        self.cause = cause
        self.worker_id = worker_id
        self.reason = reason


@dataclass(eq=False)
class WorkerLostNotice:
    """Put on an attempt's queue when a worker it depends on is lost."""

    worker_id: str
    reason: str


@dataclass(eq=False)
class MoveNotice:
    """Put on an attempt's queue when its decode worker, being drained, has held its sequence: the attempt
    ends (to be moved) once the client has every one of the `num_tokens` it produced there."""

    worker_id: str
    num_tokens: int
    method: Method


Notice = WorkerLostNotice | MoveNotice


@dataclass(eq=False)
class Attempt:
    key: str  # the id every worker knows this attempt by
    prompt: list[int]  # the original prompt + every token already streamed to the client
    params: SamplingParams  # max_tokens reduced by the tokens already streamed
    priority: int = 0  # the request's class (`ValidatedRequest.priority`): the admission queue serves higher first
    prefill: Worker | None = None
    decode: Worker | None = None
    reservation: Reservation | None = None
    promised: int = 0  # decode blocks counted on `decode` for a prompt whose reservation comes later
    prefill_tokens: int = 0  # uncached prompt tokens the prefill worker will compute (its queue, as counted)
    phase: Phase = Phase.QUEUED  # its request's phase while it is under way (`RequestState.phase`)
    # the decode worker's deltas for this attempt, or a notice
    queue: asyncio.Queue[TokenDelta | Notice] = field(default_factory=asyncio.Queue)
    # the first loss of a worker this attempt waits on, once known (wakes a pending prefill call); the same
    # notice goes on `queue` for a reader of decode steps. Made in the event loop, as attempts are
    lost: asyncio.Future[WorkerLostNotice] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    held: TokenDelta | Notice | None = None  # taken off `queue` while merging, handled next
    num_output: int = 0  # tokens of this attempt the client has (its decode worker counts the same ones)
    move: MoveNotice | None = None  # drained: end the attempt once num_output reaches move.num_tokens
    moving: bool = False  # a drain is holding or moving it
    moved_from: Worker | None = None  # a KV move's source: this attempt began DECODING with its KV
    # backpressure: whether the decode worker should hold it out of the batch (the client reads too slowly),
    # and what it was last told; one `flow_task` at a time brings the two together
    want_paused: bool = False
    applied_paused: bool = False
    flow_task: asyncio.Task | None = None
    created: float = field(default_factory=time.time)  # waits for room or a live worker count from here

    def forget_placement(self) -> None:
        """The workers tried during placement hold nothing for this attempt (any more): start afresh."""
        self.prefill = self.decode = None
        self._forget_loss()
        self.queue = asyncio.Queue()
        self.held = None

    def forget_decode(self) -> None:
        """The decode worker tried during placement holds nothing for this attempt (any more)."""
        self.decode = None
        if self.lost_notice is not None and self.prefill is not None and self.prefill.alive:
            self._forget_loss()  # the loss was the forgotten decode worker's
            self.queue = asyncio.Queue()
            self.held = None

    def check_move(self) -> None:
        """A drained attempt ends once the client has every token its decode worker produced for it."""
        if self.move is not None and self.num_output >= self.move.num_tokens:
            raise AttemptFailed(Cause.DRAIN, self.move.worker_id, f"drained ({self.move.method.value} move)")

    @property
    def lost_notice(self) -> WorkerLostNotice | None:
        """The first loss of a worker this attempt waits on, or None."""
        return self.lost.result() if self.lost.done() else None

    def _forget_loss(self) -> None:
        if self.lost.done():  # (a pending one may have waiters: it stays)
            self.lost = asyncio.get_running_loop().create_future()

    def worker_lost(self, notice: WorkerLostNotice) -> None:
        """A worker this attempt depends on is lost: the one place that tells it (`StepStreams.on_worker_lost`)."""
        if not self.lost.done():
            self.lost.set_result(notice)
        self.queue.put_nowait(notice)


@dataclass
class Timing:
    """Seconds spent in each stage before the first token (and the first decode step after it)."""

    queue: float = 0.0  # arrival -> prefill scheduled (admission wait, placement, worker queue)
    prefill: float = 0.0  # prefill scheduled -> first token sampled
    kv_transfer: float = 0.0  # first token sampled -> KV landed on the decode worker
    decode_admit: float = 0.0  # first token out -> first decode step's token out


@dataclass
class RequestState:
    """What the router knows of one request; `id` is the router's, `client_id` only a label."""

    id: str
    req: ValidatedRequest
    arrival: float = field(default_factory=time.time)
    # the phase while no attempt holds it (QUEUED before the first, MIGRATING between two, the final one);
    # None while an attempt is under way: then its `Attempt.phase` is the request's, kept there alone
    _phase: Phase | None = field(default=Phase.QUEUED, init=False, repr=False)
    generated: list[int] = field(default_factory=list)  # tokens already streamed to the client
    attempt: Attempt | None = None
    num_attempts: int = 0
    failures: list[AttemptFailed] = field(default_factory=list)
    # of the attempt that produced the first token (what metrics and the response report)
    pool: PoolKind | None = None  # the pool whose TTFT this is: PREFILL, DECODE (prefilled locally) or COLOCATED
    # REMOTE (prefill pool + KV transfer), LOCAL (its decode worker) or, on a colocated worker, COLOCATED
    placement: Path | PoolKind | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    num_cached_tokens: int = 0
    timing: Timing = field(default_factory=Timing)
    history: list[Phase] = field(default_factory=lambda: [Phase.QUEUED])
    last_event_at: float = 0.0  # when tokens last reached the client
    migrating_since: float | None = None  # set while migrating: the pause the client sees starts here
    last_method: Method = Method.RECOMPUTE  # how it last migrated

    @property
    def client_id(self) -> str:
        return self.req.request_id

    @property
    def phase(self) -> Phase:
        if self._phase is not None or self.attempt is None:
            return self._phase or Phase.QUEUED
        return self.attempt.phase

    @property
    def finished(self) -> bool:
        return self.phase.is_finished

    def to(self, phase: Phase) -> None:
        assert phase in _MOVES.get(self.phase, frozenset()) or (phase in _ENDS and not self.phase.is_finished), \
            f"request {self.id}: illegal move {self.phase.name} -> {phase.name}"
        self.history.append(phase)
        if self.attempt is not None and not phase.is_finished and phase is not Phase.MIGRATING:
            self.attempt.phase, self._phase = phase, None  # an attempt's phase: kept on the attempt
        else:
            self._phase = phase  # the request's own, between attempts or at its end

    def new_attempt(self, kv_move: bool = False) -> Attempt:
        """The next attempt: the prompt so far, and what is left of max_tokens. `kv_move`: the attempt
        takes over a running sequence with its KV, which covers every token but the last streamed one: that
        one is the new attempt's first token (already out), not part of its prompt."""
        self.num_attempts += 1
        assert self.generated or not kv_move, "a KV move needs a streamed token"
        history = self.generated[:-1] if kv_move else self.generated
        params = self.req.params
        if history:
            params = dataclasses.replace(params, max_tokens=params.max_tokens - len(history))
        self.attempt = Attempt(f"{self.id}.{self.num_attempts}", self.req.prompt_token_ids + history, params,
                               self.req.priority)
        return self.attempt
