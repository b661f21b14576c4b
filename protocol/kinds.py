"""The enums pdserve's processes share: one spelling per concept.

Each is a `str` enum whose value is its spelling at the edges (metrics labels, JSON, CLI flags), so
`PoolKind("decode")` parses an edge string and `.value` writes one; inside pdserve only the members move.
"""

from __future__ import annotations

import enum


class PoolKind(str, enum.Enum):
    """A worker's role, and the pool it belongs to."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefills and decodes its own requests: no KV transfer

    @property
    def prefills(self) -> bool:
        return self is not PoolKind.DECODE

    @property
    def decodes(self) -> bool:
        return self is not PoolKind.PREFILL


class FinishReason(str, enum.Enum):
    """Why a sequence ended, as its worker reports it on the last token."""

    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled: the client went away, or the router ended the attempt
    ERROR = "error"  # a failure (KV transfer, engine step) ended it

    @property
    def is_failure(self) -> bool:
        """The worker gave up on the sequence: the router must not treat its tokens as complete."""
        return self in (FinishReason.ABORT, FinishReason.ERROR)


class Path(str, enum.Enum):
    """How a request reaches its decode worker (the `path` label of the placement metric)."""

    REMOTE = "remote"  # prefilled on a prefill worker, its KV shipped to the decode worker
    LOCAL = "local"  # prefilled by the decode worker itself: no transfer, no prefill queue


class Cause(str, enum.Enum):
    """Why an attempt failed (the `cause` label of the migration metric)."""

    PREFILL_LOST = "prefill_lost"  # the prefill worker died or was declared dead mid-prefill
    DECODE_LOST = "decode_lost"  # the decode (or colocated) worker died or was declared dead
    KV_TRANSFER = "kv_transfer"  # the KV transfer failed or timed out
    RESERVATION = "reservation"  # the decode reservation lapsed or failed before decoding began
    WORKER_ERROR = "worker_error"  # the worker ended the sequence with an error (a failed engine step)
    DRAIN = "drain"  # not a failure: its decode worker is being drained (scale down, rolling restart)


class Method(str, enum.Enum):
    """How a request migrates (the `method` label of the migration metric)."""

    KV = "kv"  # the running sequence's KV moves to another decode worker; nothing is recomputed
    RECOMPUTE = "recompute"  # placed again with prompt + tokens so far: prefilled anew
