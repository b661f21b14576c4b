"""Step streams: each decode worker's per-step messages, fanned out to the attempts they are for.

One consumer task per decode (or colocated) worker reads its step stream for as long as it lives
(`consume_steps`): it folds the step's load report, times the worker's decode steps for the cost model, and
puts each sequence's tokens on its attempt's queue. An attempt reads its queue (`next_delta`), merging what
waits there into one delta. A stream with `max_buffered_steps` undelivered steps is paused on its worker
(backpressure from a slow client) and resumed once read down to a quarter of that (`_flow`).

A worker lost is signalled to each attempt that depends on it here (`on_worker_lost`), once, through
`Attempt.worker_lost`; a drained worker's hold reaches its attempt as a `MoveNotice` on the same queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from protocol import Cause
from protocol.messages import DestinationWanted, FirstToken, LoadReport, PrefillResult, TokenDelta
from router.admission import Admission
from router.cache_view import CacheView
from router.lifecycle import Attempt, AttemptFailed, MoveNotice, Notice, Phase, WorkerLostNotice
from router.registry import Worker
from router.shared import Shared
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)

__all__ = ["StepStreams"]


class StepStreams:
    def __init__(self, shared: Shared, cache: CacheView, admission: Admission) -> None:
        self.shared = shared
        self.config = shared.config
        self.registry = shared.registry
        self.cost = shared.cost
        self.cache = cache
        self.admission = admission

    def on_worker_added(self, worker: Worker) -> None:
        if worker.info.kv_bytes_per_token:
            self.cost.bytes_per_token = worker.info.kv_bytes_per_token
        if worker.kind.decodes:
            self.shared.background.spawn(self.consume_steps(worker))
        self.shared.room.set()

    def on_worker_lost(self, worker: Worker, why: str) -> None:
        """Never place on it again; the attempts that depend on it now fail (and migrate)."""
        self.cache.forget(worker)
        self.cost.forget(worker.worker_id)
        self.shared.observer.on_worker_lost(worker)
        notice = WorkerLostNotice(worker.worker_id, why)
        for att in list(self.shared.attempts.values()):
            # NOTE: a prefill worker's loss matters only while the attempt is prefilling on it: a request
            # already decoding elsewhere holds nothing there.
            if att.decode is worker and att.reservation is None and att.promised and att.prefill is not worker:
                # NOTE: chosen for a prompt whose blocks are reserved later, it holds nothing for it yet: the
                # prompt will be given another decode worker when it asks (`Admission.reserve_late`)
                self.admission.unpromise(att)
                att.decode = None
                continue
            if att.decode is worker or (att.prefill is worker and att.phase <= Phase.PREFILLING):
                att.worker_lost(notice)
        self.shared.room.set()

    async def consume_steps(self, worker: Worker) -> None:
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
                    self.cache.apply_report(worker, LoadReport(worker.worker_id, out.load))
                for delta in out.deltas:
                    att = self.shared.attempts.get(delta.request_id)
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

    async def next_delta(self, att: Attempt, worker: Worker) -> TokenDelta:
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
            self.shared.room.set()
        return item

    async def _take(self, att: Attempt, worker: Worker) -> TokenDelta:
        while True:
            item, att.held = (att.held, None) if att.held is not None else (await att.queue.get(), None)
            if isinstance(item, TokenDelta):
                break
            if isinstance(item, MoveNotice):
                att.move = item
                att.check_move()  # else tokens it produced before the hold are still on their way
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
            att.flow_task = self.shared.background.spawn(self._flow(worker, att))

    async def _flow(self, worker: Worker, att: Attempt) -> None:
        """Bring the decode worker to the attempt's wanted pause state (backpressure from a slow client),
        one call at a time, so a resume never overtakes its pause, retrying what fails until it holds, the
        attempt ends or the worker is lost (a lost pause would leave the stream stuck forever)."""
        while att.key in self.shared.attempts and worker.alive and att.applied_paused != att.want_paused:
            want = att.want_paused
            try:
                await (worker.client.pause if want else worker.client.resume)(att.key, self.config.call_timeout_s)
                att.applied_paused = want
            except WorkerError as e:
                self.shared.call_failed(worker, e, Cause.WORKER_ERROR)
                logger.warning("%s of %s on %s failed, retrying: %s", "pause" if want else "resume", att.key,
                               worker.worker_id, e)
                await asyncio.sleep(0.1)

    async def prefill_items(self, att: Attempt, prefill: Worker
                            ) -> AsyncIterator[DestinationWanted | FirstToken | PrefillResult]:
        """The prefill stream's items (the first token, then the outcome), abandoned as soon as either of the
        attempt's workers is lost."""
        items = aiter(prefill.client.prefill(att.key, att.prompt, att.params, att.reservation,
                                             self.shared.index.cursor(prefill.worker_id),
                                             verify_kv=self.shared.config.verify_kv_moves))
        lost = att.lost  # (awaited, never cancelled here: it is the attempt's)
        try:
            while True:
                nxt = asyncio.ensure_future(anext(items))
                await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                while not nxt.done() and not att.lost.done():
                    # NOTE: a loss that was forgotten while this stream was suspended (`reserve_late` found the
                    # decode worker it tried lost and reserved on another): wait on
                    lost = att.lost
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
                    raise self.shared.call_failed(prefill, e, Cause.PREFILL_LOST) from e
                yield item
        finally:
            with contextlib.suppress(Exception):
                await items.aclose()
