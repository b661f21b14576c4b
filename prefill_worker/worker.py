"""PrefillWorker: computes prompts, samples their first token, and pushes their KV to a decode worker.

A Ray actor holding one model replica. `prefill` is one streaming remote call per request: it queues the
prompt and yields twice: the first token (`FirstToken`) the moment it is sampled, so the client gets it at
once, then the outcome (`PrefillResult`) once the KV has landed on the decode worker (or the transfer
failed). Inside, an EngineLoop thread batches waiting prompts under the token budget. On the
step that finishes a prompt, the worker opens the transfer before the model runs and ships each layer's
blocks as soon as that layer is written, so the copy overlaps the remaining layers' compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from engine.backend import EngineBackend, LayerHook, create_engine
from engine.config import EngineConfig, cdiv
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.worker_base import Closable, WorkerBase
from kv_transfer import KVSender, KVTransferConfig, TransferResult, create_sender
from protocol.kinds import FinishReason, PoolKind
from protocol.messages import (
    DestinationWanted,
    FirstToken,
    LoadReport,
    PrefillResult,
    Reservation,
    StepOutput,
)


@dataclass
class _Job:
    """A prompt's bookkeeping here; its state is its request's `status` (SENDING_KV: the KV is on its way)."""

    request: Request
    outbox: asyncio.Queue  # [DestinationWanted], FirstToken, then the PrefillResult; filled from the loop
    actor_loop: asyncio.AbstractEventLoop  # thread through the actor's event loop
    reservation: Reservation | None = None  # the decode worker's blocks; None until `set_destination`
    destination_asked: bool = False
    scheduled_at: float = 0.0
    sampled_at: float = 0.0
    transfer_opened_at: float | None = None  # None: no transfer opened (yet, or nothing to send)
    transfer_bytes: int = 0
    cache_since: int | None = None  # the asking router's cache cursor: its result carries the changes after it
    # a first token sampled before the decode blocks were reserved (an engine that does not hold a prompt's
    # last chunk for them: vLLM): it goes out with the destination, since the router starts the decode
    # worker on it
    deferred: FirstToken | None = None
    verify_kv: bool = False  # --verify-kv-moves: the result carries the SHA-256 of the prompt's KV as sent


class PrefillWorker(WorkerBase):
    kind = PoolKind.PREFILL

    def __init__(self, worker_id: str, config: EngineConfig, kv_config: KVTransferConfig, *,
                 engine: EngineBackend | None = None, sender: KVSender | None = None) -> None:
        """`engine` and `sender`: made from `config` and `kv_config` unless passed in (tests pass their own)."""
        if engine is None:
            engine = create_engine(config)
        super().__init__(worker_id, engine)
        self.kv_config = kv_config
        self.sender = sender if sender is not None else create_sender(kv_config, worker_id, engine.kv_cache,
                                                                      self.node_ip)
        self.jobs: dict[str, _Job] = {}
        # a prompt sent without its decode reservation asks for one once this many of its tokens are left:
        # two steps' worth, so it lands before the step that computes the last chunk (and ships the KV)
        sched = config.scheduler
        step = (sched.prefill_chunk_tokens if sched.prefill_order == "fair" else 0) or sched.max_num_batched_tokens
        self.destination_horizon = 2 * min(step, sched.max_num_batched_tokens)
        self._start_loop(layer_hook_for=self._hook_for)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      reservation: Reservation | None, cache_since: int | None = None, verify_kv: bool = False
                      ) -> AsyncIterator[DestinationWanted | FirstToken | PrefillResult]:
        """Compute the prompt and push its KV into `reservation`: yields the first token as soon as it is
        sampled, then the outcome once the KV landed (a failure yields only the outcome). The outcome's load
        report carries the prefix-cache changes after `cache_since` (the asking router's cursor), so its
        index holds the prompt's blocks before its next placement. `verify_kv`: the outcome carries the
        SHA-256 of the prompt's KV as sent, read before its blocks are released (`--verify-kv-moves`).

        `reservation` None: the decode blocks are not reserved yet. Every chunk but the last is computed
        meanwhile; once `destination_horizon` tokens are left, it yields `DestinationWanted`, and the last
        chunk waits for `set_destination`."""
        outbox: asyncio.Queue = asyncio.Queue()
        actor_loop = asyncio.get_running_loop()

        def add() -> None:
            if request_id in self.jobs:
                raise ValueError(f"request {request_id!r} is already prefilling on {self.worker_id}")
            req = self.engine.make_request(request_id, prompt_token_ids, params, prefill_only=True,
                                           awaiting_destination=reservation is None)
            self.engine.enqueue(req)
            job = self.jobs[request_id] = _Job(req, outbox, actor_loop, cache_since=cache_since, verify_kv=verify_kv)
            if reservation is not None:
                self._set_destination(job, reservation)
            self._ask_destinations()

        await self._on_loop(add)
        while True:
            item = await outbox.get()
            yield item
            if isinstance(item, PrefillResult):
                return

    async def set_destination(self, request_id: str, reservation: Reservation) -> bool:
        """The decode blocks of a prompt sent without them: its last chunk may run. False when the prompt is
        no longer here (aborted, failed)."""

        def set_() -> bool:
            job = self.jobs.get(request_id)
            if job is None:
                return False
            self._set_destination(job, reservation)
            if job.deferred is not None:
                _put(job, job.deferred)
                job.deferred = None
                self._ship_computed(job)
            return True

        return await self._on_loop(set_)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds (benchmarks measure cold prefills with it)."""
        await self._on_loop(self.engine.reset_prefix_cache)

    # -- the base's hooks -------------------------------------------------------------------------------

    def _info_fields(self) -> dict[str, Any]:
        return {"destination_horizon_tokens": self.destination_horizon}

    def _transports(self) -> Iterable[Closable]:
        return (self.sender,)

    def _attempt_keys(self) -> Iterable[str]:
        return list(self.jobs)

    def _describe(self) -> dict:
        return {"jobs": {rid: {"status": j.request.status.name, "transfer_open": j.transfer_opened_at is not None,
                               "transfer": self.sender.poll(rid).name if j.transfer_opened_at is not None else None}
                         for rid, j in self.jobs.items()},
                "requests": {rid: r.status.name for rid, r in self.engine.requests.items()}}

    # -- on the loop thread -----------------------------------------------------------------------------

    def _hook_for(self, out: SchedulerOutput) -> LayerHook | None:
        now = time.time()
        sending = []
        for chunk in out.chunks:
            job = self.jobs.get(chunk.request.request_id)
            if job is None:
                continue
            job.scheduled_at = job.scheduled_at or now
            # the prompt's last chunk: ship every layer
            if chunk.end == job.request.num_prompt_tokens and job.reservation is not None and self._open_transfer(job):
                sending.append(job.request.request_id)
        if not sending:
            return None
        timeout = self.kv_config.transfer_timeout_s

        def hook(layer: int) -> None:
            # NOTE: the deadline measures progress, not wall time: a slow step (a long last chunk on a busy
            # machine) keeps its transfer alive as long as layers keep coming
            until = time.monotonic() + timeout
            for rid in sending:
                self.sender.extend(rid, until)
                self.sender.send_layer(rid, layer)

        return hook

    def _open_transfer(self, job: _Job) -> bool:
        req, dst = job.request, job.reservation
        skip = dst.num_cached_blocks
        n = cdiv(req.num_prompt_tokens, self.engine.cache_spec.block_size)
        if skip >= n:
            return False  # the decode worker holds the whole prompt already
        # NOTE: the whole prompt's blocks go in the last chunk's step, earlier chunks included: they are
        # final by then, and one transfer per request keeps the receiver's bookkeeping trivial.
        self.sender.begin(req.request_id, dst.kv_address, req.block_ids[skip:n], dst.block_ids[skip:n],
                          time.monotonic() + self.kv_config.transfer_timeout_s)
        job.transfer_opened_at = time.time()
        job.transfer_bytes = (n - skip) * self.engine.cache_spec.bytes_per_block
        return True

    def _ship_computed(self, job: _Job) -> None:
        """A destination for a prompt computed already (an engine that does not hold a prompt's last chunk
        for it: vLLM): every layer goes at once, as a drain's move does."""
        if not self._open_transfer(job):
            self._finish(job, None)
            return
        rid = job.request.request_id
        self.sender.extend(rid, time.monotonic() + self.kv_config.transfer_timeout_s)
        for layer in range(self.engine.cache_spec.num_layers):
            self.sender.send_layer(rid, layer)

    def _fail_transfers(self, requests: list[Request]) -> None:
        """A failed step ends these requests: fail their transfers before their blocks are freed."""
        for r in requests:
            job = self.jobs.get(r.request_id)
            if job is not None and job.transfer_opened_at is not None:
                self.sender.abort(r.request_id, "the prefill worker's engine step failed")
                job.transfer_opened_at = None

    def _on_step(self, out: StepOutput) -> None:
        for delta in out.deltas:
            job = self.jobs.get(delta.request_id)
            if job is None:
                continue
            job.sampled_at = out.time
            if delta.finish_reason is FinishReason.ERROR:
                self._end(delta.request_id, "the prefill step failed")
                continue
            req = job.request
            stop = req.check_stop()
            first = FirstToken(req.request_id, req.output_token_ids[0], None if stop is None else FINISH_REASONS[stop],
                               req.num_cached_tokens, job.scheduled_at, job.sampled_at, req.prefill_compute_s)
            if job.reservation is None:  # computed ahead of its destination: both go out together
                job.deferred = first
                if not job.destination_asked:
                    job.destination_asked = True
                    _put(job, DestinationWanted(req.request_id))
                continue
            _put(job, first)
            if job.transfer_opened_at is None:  # nothing to send: done as soon as sampled
                self._finish(job, None)

    @staticmethod
    def _set_destination(job: _Job, reservation: Reservation) -> None:
        job.reservation = reservation
        job.request.awaiting_destination = False

    def _ask_destinations(self) -> None:
        """Ask the router for the decode blocks of each prompt without them that is close to its last chunk."""
        for job in self.jobs.values():
            req = job.request
            if (req.awaiting_destination and not job.destination_asked
                    and req.num_prompt_tokens - req.num_computed_tokens <= self.destination_horizon):
                job.destination_asked = True
                _put(job, DestinationWanted(req.request_id))

    def _poll(self) -> bool:
        self._ask_destinations()
        for result in self.sender.pop_finished():
            job = self.jobs.get(result.request_id)
            if job is not None:
                self._finish(job, result)
        # between steps, a prompt still here in SENDING_KV is one whose KV is on its way
        return any(j.request.status is RequestStatus.SENDING_KV for j in self.jobs.values())

    def _finish(self, job: _Job, transfer: TransferResult | None) -> None:
        req = job.request
        del self.jobs[req.request_id]
        error = None if transfer is None or transfer.ok else f"KV transfer failed: {transfer.error}"
        first = req.output_token_ids[0] if req.output_token_ids else None
        if error is None and first is None:
            error = "KV transfer finished before the first token was sampled"
        stop = req.check_stop() if first is not None else None
        digest = None
        if job.verify_kv and error is None and transfer is not None:  # before its blocks go
            digest = self.engine.kv_digest(req.request_id, req.num_prompt_tokens,
                                            job.reservation.sent_from(self.engine.cache_spec.block_size))
        # the worker is done with the request either way; its full blocks stay in the prefix cache
        self.engine.finish(req, RequestStatus.FINISHED_ERROR if error else (stop or RequestStatus.FINISHED_LENGTH))
        now = time.time()
        opened = job.transfer_opened_at
        result = PrefillResult(req.request_id, first, None if stop is None else FINISH_REASONS[stop],
                               req.num_cached_tokens, error, job.scheduled_at, job.sampled_at, now,
                               now - opened if opened is not None else 0.0,
                               job.transfer_bytes, transfer is not None and not transfer.ok,
                               self.engine.load_report(self.worker_id, job.cache_since), digest)
        _put(job, result)

    def _abort(self, request_id: str, reason: str = "aborted by the router") -> None:
        self._end(request_id, reason)

    def _end(self, request_id: str, reason: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        if job.transfer_opened_at is not None:
            self.sender.abort(request_id, reason)
        self.engine.finish(job.request, RequestStatus.FINISHED_ABORTED)
        _put(job, PrefillResult(request_id, None, None, job.request.num_cached_tokens, reason,
                                report=self._report()))

    def _report(self) -> LoadReport:
        # NOTE: only the newest cache change's number: the router reads the changes themselves from its own
        # cursor (`report`), since other router replicas read this worker's cache too
        return self.engine.load_report(self.worker_id, None)


def _put(job: _Job, item: DestinationWanted | FirstToken | PrefillResult) -> None:
    """Hand a job's message to its `prefill` stream, from the loop thread."""
    job.actor_loop.call_soon_threadsafe(job.outbox.put_nowait, item)
