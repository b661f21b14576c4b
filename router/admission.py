"""Admission and placement: where each attempt prefills and decodes, and holding what it needs there.

Disaggregated attempt:
  1. prefill worker = lowest cost of (uncached prompt tokens + queued prefill tokens) (`choose_prefill`),
     among live workers whose queued prefill tokens stay under `max_queued_prefill_tokens`;
  2. decode worker = same node as that prefill worker when one has room, else most free blocks
     (`choose_decode`); `reserve` there returns the destination blocks as a lease, or None when it is out
     of room, in which case the request waits in a bounded admission queue (`router.admission_queue`; past
     the bound: RESOURCE_EXHAUSTED at once, before any prefill). The lease is renewed on every heartbeat of
     the prefill worker (`on_heartbeat`), so it lasts as long as the prefill makes progress, however long
     that is. A prompt longer than its prefill worker's horizon is reserved late instead, when that worker
     nears its last chunk (`_may_defer`, `reserve_late`): blocks reserved at placement would sit idle while
     it queues. With joint placement (the default) the (prefill, decode) pair, or the decode worker alone, is
     the cheapest by the cost model (`placement.choose_path`).

The prompt's uncached tokens count in its prefill worker's queue (`Worker.inflight_prefill_tokens`) from the
moment of choice: `count_prefill` and `uncount_prefill` are the only places that change it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict

from engine.config import cdiv
from protocol import Cause, Path, PoolKind
from protocol.block_hash import hash_blocks, salt_root
from protocol.messages import Reservation
from router.admission_queue import AdmissionQueue
from router.lifecycle import Attempt, AttemptFailed, Phase
from router.placement import PrefillChoice, RoundRobinPrefill, choose_decode, choose_path, choose_prefill
from router.registry import Worker
from router.shared import RouterError, Shared
from router.worker_client import WorkerError

logger = logging.getLogger(__name__)

__all__ = ["Admission"]


class Admission:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.config = shared.config
        self.block_size = shared.block_size
        self.registry = shared.registry
        self.index = shared.index
        self.cost = shared.cost
        self.policy = choose_prefill if self.config.policy == "prefix" else RoundRobinPrefill()
        self.queue = AdmissionQueue(shared)  # where attempts wait for decode room

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    # -- leases -----------------------------------------------------------------------------------------

    def on_heartbeat(self, worker: Worker) -> None:
        """A prefill worker is alive and moving: renew the decode leases of the prompts it is computing."""
        if worker.kind is not PoolKind.PREFILL:
            return
        by_decode: dict[str, list[str]] = defaultdict(list)
        for att in self.shared.attempts.values():
            if (att.prefill is worker and att.phase is Phase.PREFILLING and att.reservation is not None
                    and att.decode is not None and att.decode.alive):
                by_decode[att.decode.worker_id].append(att.key)
        for wid, keys in by_decode.items():
            self.shared.background.spawn(self._renew(self.workers[wid], keys))

    async def _renew(self, decode: Worker, keys: list[str]) -> None:
        try:
            gone = await decode.client.renew(keys, self.config.call_timeout_s)
        except WorkerError as e:
            logger.warning("lease renewal on %s failed: %s", decode.worker_id, e)
            return
        if gone:
            logger.warning("reservations %s on %s lapsed before their prefill finished", gone, decode.worker_id)

    # -- placement --------------------------------------------------------------------------------------

    async def place(self, att: Attempt) -> Path:
        """Choose where the attempt prefills and decodes, and hold what it needs there: the prefill worker
        (its queue counts the prompt from here) and a reservation on the decode worker, or, on the local
        path, just the decode worker (which prefills the prompt itself)."""
        if self.config.placement == "separate":  # prefill worker first, then a decode worker for it
            choice = await self.choose_prefill(att)
            prefill = self._take_prefill(att, self.workers[choice.worker_id], choice.cached_blocks)
            try:
                att.decode, att.reservation = await self._reserve(att, prefill)
            except BaseException:
                self.uncount_prefill(prefill, att.prefill_tokens)
                raise
            return Path.REMOTE
        return await self._place_jointly(att)

    def _take_prefill(self, att: Attempt, prefill: Worker, cached_blocks: int) -> Worker:
        att.prefill = prefill
        # NOTE: counted from the moment of choice, so a burst of requests placed together spreads out
        att.prefill_tokens = len(att.prompt) - cached_blocks * self.block_size
        self.count_prefill(prefill, att.prefill_tokens)
        return prefill

    async def _place_jointly(self, att: Attempt) -> Path:
        """The cheapest (prefill, decode) pair, or the decode worker alone, by the cost model
        (`placement.choose_path`), trying the next option when a decode worker turns out to be full, and
        waiting in the admission queue when none has room."""
        n, bs = len(att.prompt), self.block_size
        need = cdiv(n, bs)
        hashes = hash_blocks(att.prompt, bs, parent=salt_root(att.params.cache_salt))
        deadline = att.created + self.config.admission_timeout_s
        while True:
            prefills = self.registry.schedulable(PoolKind.PREFILL)
            decoders = self.registry.schedulable(PoolKind.DECODE)
            if not prefills or not decoders:
                missing = "prefill" if not prefills else "decode"
                await self.shared.wait_room(deadline, "UNAVAILABLE", f"no live {missing} worker: the {missing} pool is "
                                      "being replaced; check its workers' logs")
                continue
            self.check_fits(need, decoders, PoolKind.DECODE)
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
                        self.uncount_prefill(prefill, att.prefill_tokens)
                if att.reservation is not None:
                    return Path.REMOTE
                full.add(decode.worker_id)
                att.forget_placement()
            await self.queue.wait_for_room(need, deadline, att.priority)

    async def choose_prefill(self, att: Attempt) -> PrefillChoice:
        """A live prefill (or colocated) worker for the attempt's prompt, waiting for one while none is alive."""
        kind = PoolKind.PREFILL if self.shared.disaggregated else PoolKind.COLOCATED
        ids = att.prompt
        hashes = hash_blocks(ids, self.block_size, parent=salt_root(att.params.cache_salt))
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
                choice = self.policy(hashes, open_, self.index, self.block_size, len(ids))
                assert choice is not None
                return choice
            await self.shared.wait_room(deadline, "UNAVAILABLE", f"no live {kind.value} worker: the {kind.value} pool "
                                  "is being replaced; check its workers' logs")

    async def _reserve(self, att: Attempt, prefill: Worker) -> tuple[Worker, Reservation]:
        """A decode worker with room for the prompt's blocks, waiting in the admission queue if none has."""
        need = cdiv(len(att.prompt), self.block_size)
        deadline = att.created + self.config.admission_timeout_s
        while True:
            decoders = self.registry.schedulable(PoolKind.DECODE)
            if not decoders:
                await self.shared.wait_room(deadline, "UNAVAILABLE", "no live decode worker: the decode pool is being "
                                      "replaced")
                continue
            self.check_fits(need, decoders, PoolKind.DECODE)
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
            self.uncount_prefill(prefill, att.prefill_tokens)
            try:
                await self.queue.wait_for_room(need, deadline, att.priority)
            finally:
                self.count_prefill(prefill, att.prefill_tokens)

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
            self.shared.call_failed(decode, e, Cause.DECODE_LOST)
            self.shared.abort_soon(decode, att.key)  # it may have reserved before timing out
            logger.warning("reserve on %s failed: %s", decode.worker_id, e)
            return None
        if reservation is not None and decode.alive and prefill.alive:
            return reservation
        if reservation is not None:  # one of the two was lost during the call
            self.shared.abort_soon(decode, att.key)
        else:
            decode.load = dataclasses.replace(decode.load, free_blocks=0)  # until its next report
        return None

    @staticmethod
    def count_prefill(prefill: Worker, tokens: int) -> None:
        """`tokens` more prompt tokens wait on `prefill` (what placement reads as its queue)."""
        prefill.inflight_prefill_tokens += tokens

    @staticmethod
    def uncount_prefill(prefill: Worker, tokens: int) -> None:
        """`tokens` of the prompt tokens counted on `prefill` are computed, or no longer wait there."""
        prefill.inflight_prefill_tokens -= tokens

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
        find no room when due, and those wait for it (`reserve_late`) with their KV held on the prefill
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

    def unpromise(self, att: Attempt) -> None:
        if att.promised and att.decode is not None:
            att.decode.promised_blocks -= att.promised
        att.promised = 0

    async def reserve_late(self, att: Attempt, prefill: Worker) -> Worker:
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
        self.unpromise(att)
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
                    await self.shared.wait_room(deadline, "UNAVAILABLE", "no live decode worker for a prompt nearing "
                                          "the end of its prefill: the decode pool is being replaced")
                    continue
                await self.shared.wait_room(deadline, "RESOURCE_EXHAUSTED", f"no decode worker had room for {need} KV "
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
            raise self.shared.call_failed(prefill, e, Cause.PREFILL_LOST) from e
        if not ok:
            raise AttemptFailed(Cause.WORKER_ERROR, prefill.worker_id, "the prompt left its prefill worker before "
                                "its decode blocks were set")
        return att.decode

    @staticmethod
    def check_fits(need: int, workers: list[Worker], pool: PoolKind) -> None:
        """A prompt larger than any worker's whole KV cache can never be served: refuse it, not retry it."""
        largest = max(w.load.total_blocks for w in workers)
        if need > largest:
            raise RouterError("INVALID_ARGUMENT", f"prompt: needs {need} KV blocks but the largest {pool.value} worker "
                              f"holds {largest}; shorten the prompt or give the workers more KV memory")

