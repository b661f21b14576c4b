"""`--verify-kv-moves` on the prefill-to-decode path: the KV a decode worker holds against what was sent.

The prefill worker digests the prompt's K and V as it sent them, before releasing its blocks (the digest rides
its `PrefillResult`); once the decode worker has started the sequence, the router asks it for the digest of
the same positions. Equal, the request goes on; different, the attempt fails as a KV transfer would (and is
retried), so no client decodes from KV that differs from what was computed. Every check is kept for operators
and tests (`Router.kv_checks`), as drains keep their moves (`Router.kv_moves`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from protocol import Cause
from router.lifecycle import Attempt, AttemptFailed
from router.registry import Worker
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCheck:
    """One prefill's KV, as sent and as its decode worker holds it."""

    request_id: str
    src: str
    dst: str
    start: int  # the first position compared: those before it were cached on the decode worker, not sent
    num_tokens: int  # the prompt's KV positions, up to which they are compared
    src_digest: str
    dst_digest: str | None  # None: the decode worker no longer held the sequence when asked (it had ended)

    @property
    def equal(self) -> bool:
        return self.src_digest == self.dst_digest


async def forget(worker: Worker, key: str, start: int, timeout: float) -> None:
    """A check failed: take the KV `worker` received for `key` (from position `start` on) out of its prefix
    cache before the attempt ends, or a later prompt would reuse it unchecked (its blocks would count as the
    destination's own). Best effort: a worker that cannot be reached is being lost anyway."""
    try:
        await worker.client.forget_kv(key, start, timeout)
    except WorkerError as e:
        logger.warning("could not take %s's KV out of %s's prefix cache: %s", key, worker.worker_id, e)


async def check_transfer(request_id: str, att: Attempt, prefill: Worker, decode: Worker, sent: str,
                         start: int, timeout: float, checks: deque[KVCheck]) -> None:
    """Check `att`'s transfer, whose KV the prefill worker sent with digest `sent` (of the prompt's positions
    from `start` on: those before are the blocks the decode worker's prefix cache held, not sent), into
    `checks`. Raises AttemptFailed (KV_TRANSFER) when the decode worker holds other bytes."""
    try:
        held: str | None = await decode.client.kv_digest(att.key, len(att.prompt), start, timeout)
    except WorkerError as e:  # ended meanwhile, or the worker is going: its loss is noticed elsewhere
        logger.warning("KV check of %s on %s: no digest (%s)", request_id, decode.worker_id, e)
        held = None
    check = KVCheck(request_id, prefill.worker_id, decode.worker_id, start, len(att.prompt), sent, held)
    checks.append(check)
    if held is not None and not check.equal:
        logger.error("KV of %s from %s to %s differs from what was sent", request_id, prefill.worker_id,
                     decode.worker_id)
        await forget(decode, att.key, start, timeout)
        raise AttemptFailed(Cause.KV_TRANSFER, decode.worker_id, "the KV the decode worker holds differs from "
                            "what the prefill worker sent (--verify-kv-moves)")
