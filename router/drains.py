"""Drains and KV moves: taking a worker out of service without losing what it serves.

Draining a worker (`drain_worker`: scale down, rolling restart, maintenance) stops placement on it, lets what
it prefills finish, and moves each sequence it decodes to another decode worker *with its KV*: the sequence is
held there (`_hold`), blocks for its prompt + tokens so far are reserved elsewhere, its KV is pushed
decode → decode over `kv_transfer` (`send_kv`), and a new attempt decodes on from the last streamed token
(`move_kv`). Nothing is recomputed, and the client sees one pause. A move that cannot happen falls back to
recompute.

One timeout bounds a move, `RouterConfig.kv_move_timeout_s`: the destination's reservation, the push and the
start must all end within it, and the source decode worker's transfer gets what is left of it as its deadline.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import cdiv
from protocol import Cause, Method, PoolKind
from protocol.messages import KVMoveResult
from router.kv_checks import forget
from router.lifecycle import Attempt, MoveNotice, Phase, RequestState
from router.placement import choose_decode
from router.registry import Worker
from router.shared import Shared
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)

__all__ = ["Drains", "KVMove"]


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


class Drains:
    def __init__(self, shared: Shared, end_attempt: Callable[[Attempt, bool], None]) -> None:
        self.shared = shared
        self.config = shared.config
        self.block_size = shared.block_size
        self.registry = shared.registry
        self.end_attempt = end_attempt  # the driver's: route nothing more to an attempt, free what it holds
        self.kv_moves: collections.deque[KVMove] = collections.deque(maxlen=1024)

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    def holds_work(self, worker: Worker) -> bool:
        """Whether any attempt still depends on `worker` (prefilling on it, or reserved or decoding there; a
        prompt only promised to it holds nothing there, and is reserved elsewhere when due: it is not
        schedulable any more)."""
        return any((att.decode is worker and not (att.reservation is None and att.promised))
                   or (att.prefill is worker and att.phase <= Phase.PREFILLING)
                   for att in self.shared.attempts.values())

    async def drain_worker(self, worker: Worker, method: Method = Method.KV, timeout_s: float = 300.0) -> bool:
        """Stop placing on `worker` and wait until nothing depends on it: prompts it prefills finish; each
        sequence it decodes moves to another decode worker (with its KV, `method` KV; else by recompute) as
        soon as one can take it. True once it holds nothing; False past `timeout_s` (what is left then fails
        over like a lost worker's when the caller retires it)."""
        worker.draining = True
        self.shared.room.set()
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
                for att in list(self.shared.attempts.values()):
                    if att.decode is worker and att.phase is Phase.DECODING and not att.moving:
                        att.moving = True
                        self.shared.background.spawn(self._hold(att, worker, method))
            await asyncio.sleep(0.05)
        # NOTE: the attempts that left it sent their aborts in the background: it holds nothing once answered
        await asyncio.gather(*self.shared.aborts.get(worker.worker_id, ()), return_exceptions=True)
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
            self.shared.call_failed(worker, e, Cause.WORKER_ERROR)
            logger.warning("hold of %s on %s failed: %s", att.key, worker.worker_id, e)
            num_tokens = None
        if num_tokens is None:  # not decoding right now (preempted, finishing): the drain tries it again
            await asyncio.sleep(0.1)
            att.moving = False
            return
        att.queue.put_nowait(MoveNotice(worker.worker_id, num_tokens, method))

    async def move_kv(self, state: RequestState, att: Attempt) -> Attempt | None:
        """Move a held sequence's KV from its (drained) decode worker to another; the new attempt, already
        DECODING there, or None when the move could not happen (the request then recomputes)."""
        src = att.decode
        new = state.new_attempt(kv_move=True)
        self.shared.attempts[new.key] = new
        timeout = self.config.kv_move_timeout_s
        deadline = time.monotonic() + timeout
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
                    result = await src.client.send_kv(att.key, new.key, new.reservation,
                                                      max(deadline - time.monotonic(), 0.1))
                    self.shared.observer.on_kv_move(src.worker_id, dst.worker_id, result)
                    move = KVMove(state.id, src.worker_id, dst.worker_id, len(new.prompt), result)
                    try:
                        if not result.ok:
                            logger.warning("KV move of %s from %s to %s failed: %s", state.id, src.worker_id,
                                           dst.worker_id, result.error)
                            return None
                        if not await dst.client.start(new.key, state.generated[-1], timeout):
                            return None
                        if self.config.verify_kv_moves:
                            n, sent_from = len(new.prompt), new.reservation.sent_from(self.block_size)
                            move = dataclasses.replace(
                                move, src_digest=await src.client.kv_digest(att.key, n, sent_from, timeout),
                                dst_digest=await dst.client.kv_digest(new.key, n, sent_from, timeout))
                            if move.src_digest != move.dst_digest:
                                logger.error("KV move of %s from %s to %s: the KV differs from its source",
                                             state.id, src.worker_id, dst.worker_id)
                                await forget(dst, new.key, sent_from, timeout)
                                return None
                    finally:
                        self.kv_moves.append(move)  # every move that sent its KV, whatever came of it
            except (WorkerError, TimeoutError) as e:
                if isinstance(e, WorkerError):
                    self.shared.call_failed(self.workers[e.worker_id], e, Cause.WORKER_ERROR)
                logger.warning("KV move of %s from %s failed: %s", state.id, src.worker_id, e or "timed out")
                return None
            new.num_output = 1  # the last streamed token: the new attempt's first, already out
            new.moved_from = src
            state.decode_worker = dst.worker_id
            moved = True
            return new
        finally:
            if not moved:
                self.end_attempt(new, clean=False)
