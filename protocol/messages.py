"""Plain data that crosses a process boundary between the router and the workers (Ray pickles these).

No torch and no behaviour here: the router imports this module and must never load the model. Every id a
worker sees is the router's *attempt key* (see `router.lifecycle`), never the client's request id, so two
requests (or two attempts of one request) never share state in any worker. `None` means "not set" (no
finish yet, no horizon, no cursor); no field carries a meaning in a sign or a zero.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.block_hash import BlockHash
from protocol.kinds import FinishReason, PoolKind


def _fingerprint() -> str:
    try:
        h = hashlib.sha256()
        for f in sorted(Path(__file__).parent.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        return h.hexdigest()[:12]
    except OSError:  # no source beside the bytecode: the package's version has to do
        from importlib.metadata import PackageNotFoundError, version

        try:
            return "pdserve-" + version("pdserve")
        except PackageNotFoundError:
            return "unknown"


# NOTE: the router and its workers exchange these types pickled, so both must run this very package: a
# worker started from other code (a node with another image, a checkout edited under a running
# deployment) fails to unpickle, or worse, unpickles into other meanings. Each worker says which it runs
# (`WorkerInfo.contract`) and the router refuses a stranger before it takes any traffic.
CONTRACT = _fingerprint()


@dataclass(frozen=True)
class PeerAddress:
    """Where senders find a KV receiver. The decode worker publishes its receiver's address; the router hands
    it to the prefill worker with the reserved block ids."""

    transport: str  # "torch" | "ray"
    endpoint_id: str  # the receiving worker's stable name, e.g. "decode-3"
    incarnation: str  # random per receiver object, so a restarted worker never takes a dead one's links
    device: str  # "cpu" or "cuda:<gpu uuid>": NCCL only between two different GPUs
    # ray only: the receiving process's KVInbox actor handle
    inbox: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SpecCounts:
    """Decode and speculative-decoding counts since the engine started (cumulative, so a lost report loses
    nothing): acceptance rate = accepted / draft tokens; tokens per step = decode tokens / seq steps."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_seq_steps: int = 0  # (sequence, step) pairs that decoded, speculating or not
    num_decode_tokens: int = 0  # tokens those appended


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of one engine's load, what the router's placement policy weighs."""

    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    # a decode worker's blocks held for prompts whose KV has not landed: reserved at placement, they sit
    # idle while the prompt queues and prefills on a prefill worker
    reserved_blocks: int = 0
    spec: SpecCounts = field(default_factory=SpecCounts)


@dataclass
class TokenDelta:
    request_id: str  # the router's attempt key
    token_ids: list[int]
    finish_reason: FinishReason | None  # set on the last delta of a request
    num_cached_tokens: int = 0
    error: str | None = None  # why, when finish_reason is ERROR


@dataclass(frozen=True)
class StepStats:
    """What one engine step computed, so the router's cost model can tell a decode step from one that also
    carried prompt chunks (a local prefill on a decode worker rides its decode steps)."""

    seconds: float  # the step: scheduling, the model pass and sampling
    num_prefill_tokens: int  # prompt tokens it computed
    num_decode_seqs: int  # sequences it decoded (a token each, drafts aside)


@dataclass
class StepOutput:
    step: int | None  # the engine step that produced these deltas; None for deltas sent between steps
    time: float  # when the step's tokens were sampled (time.time(), comparable across processes)
    deltas: list[TokenDelta] = field(default_factory=list)
    load: EngineLoad | None = None
    stats: StepStats | None = None  # None for deltas sent between steps


@dataclass(frozen=True)
class Heartbeat:
    """A worker's answer to `ping`, given by its actor thread, not its engine thread: a worker that answers
    but whose engine loop has not moved for long while it has work is stuck."""

    worker_id: str
    loop_age_s: float  # seconds since the engine loop last finished a step or an idle wait
    busy: bool  # the loop has scheduled work or transfers in flight
    loop_alive: bool  # the loop thread is running


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    kind: PoolKind
    node_id: str
    node_ip: str
    block_size: int
    num_blocks: int
    kv_address: PeerAddress | None = None  # a decode worker's KV receiver address
    pid: int = 0  # the actor's process (operators and the chaos tests signal it)
    kv_bytes_per_token: int = 0  # KV a token takes on the wire, every layer (placement's transfer cost)
    contract: str = CONTRACT  # the worker's own build of this module (its default is read in the worker)
    # a prefill worker: a prompt may be sent to it with no decode reservation; it asks for one
    # (`DestinationWanted`) once this many of its tokens are left to compute. None: reserve before sending
    destination_horizon_tokens: int | None = None


@dataclass
class LoadReport:
    """A worker's load, plus its prefix-cache changes numbered after `since` up to `seq` (for the router's
    index; see `engine.block_allocator.CacheEventLog`). `seq` None: load only, nothing about the cache.
    `full`: `stored` is the whole cache as of `seq` (the reader's changes were no longer kept)."""

    worker_id: str
    load: EngineLoad
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    since: int = 0
    seq: int | None = None
    full: bool = False


RouterId = str | None
"""A router replica's id (`pdserve serve --routers N`), unique per incarnation; None: the lone router, whose
attempt keys carry no owner."""


def owner_of(key: str) -> RouterId:
    """The router replica that owns an attempt key: the part before "/" (None for a lone router's keys)."""
    owner, sep, _ = key.partition("/")
    return owner if sep else None


@dataclass(frozen=True)
class Reservation:
    """Decode blocks held for one attempt's prompt, and where its KV goes."""

    kv_address: PeerAddress  # the decode worker's receiver
    block_ids: list[int]  # the decode worker's table for the whole prompt
    num_cached_blocks: int  # leading blocks already held by the decode worker's prefix cache: not sent
    lease_s: float  # the reservation lapses this long after its last renewal (see `DecodeWorker.renew`)

    def sent_from(self, block_size: int) -> int:
        """The first prompt position a transfer into it sends (and `--verify-kv-moves` compares)."""
        return self.num_cached_blocks * block_size


@dataclass(frozen=True)
class DestinationWanted:
    """A prefill worker will soon compute the last chunk of a prompt sent without a decode reservation (see
    `WorkerInfo.destination_horizon_tokens`): reserve its decode blocks now and `set_destination`. The
    prompt's KV ships in the step that computes its last chunk, which waits for the destination."""

    request_id: str


@dataclass(frozen=True)
class FirstToken:
    """A prefill worker sampled the prompt's first token: sent at once, before the KV has landed."""

    request_id: str
    token: int
    finish_reason: FinishReason | None  # set when the first token already ends the request (STOP | LENGTH)
    num_cached_tokens: int  # prompt tokens the prefill worker's prefix cache served
    scheduled_at: float  # time.time() of the prompt's first chunk
    sampled_at: float
    # seconds of engine steps spent on the prompt: each step's time shared among the prompts it computed by
    # token count (a prompt sharing its steps with others took less of the worker than scheduled -> sampled)
    compute_s: float = 0.0


@dataclass
class PrefillResult:
    request_id: str
    first_token: int | None  # None when it failed
    finish_reason: FinishReason | None  # set when the first token already ends the request (STOP | LENGTH)
    num_cached_tokens: int  # prompt tokens this worker's prefix cache served
    error: str | None = None
    # wall-clock instants (time.time()) for the router's TTFT breakdown
    scheduled_at: float = 0.0
    sampled_at: float = 0.0
    kv_done_at: float = 0.0
    kv_seconds: float = 0.0  # transfer opened -> every layer acknowledged (overlaps the prefill compute)
    kv_bytes: int = 0
    kv_failed: bool = False  # the error, if any, is the KV transfer's
    report: LoadReport | None = None
    # SHA-256 of the prompt's K and V as sent, every layer (asked for with --verify-kv-moves; None otherwise)
    kv_digest: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class KVMoveResult:
    """How a running sequence's KV went from one decode worker to another (a drain's move)."""

    ok: bool
    num_bytes: int = 0  # what crossed the link (blocks the destination already cached are not sent)
    seconds: float = 0.0  # the transfer opened -> every layer acknowledged
    error: str | None = None
