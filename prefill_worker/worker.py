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
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig, cdiv
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.models.llama import LayerHook
from engine.request import FINISH_REASONS, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kv_transfer import KVTransferConfig, TransferResult, create_sender
from protocol.kinds import FinishReason, PoolKind
from protocol.messages import (
    DestinationWanted,
    EngineLoad,
    FirstToken,
    Heartbeat,
    LoadReport,
    PeerAddress,
    PrefillResult,
    Reservation,
    StepOutput,
    WorkerInfo,
    owner_of,
)
from protocol.node import node_identity

# a prompt's KV must have landed this long after its transfer opened, or the transfer fails
# a prompt's KV transfer fails when this long passes without progress: from its opening to the first layer,
# between two layers (each layer sent pushes the deadline on), or from the last layer to the receiver's verdict
KV_TRANSFER_TIMEOUT_S = 30.0


@dataclass
class _Job:
    request: Request
    dst: PeerAddress | None  # None until the router sets the destination (`set_destination`)
    dst_block_ids: list[int]  # the decode worker's table for the whole prompt
    num_dst_cached_blocks: int  # leading blocks the decode worker already holds: not sent
    outbox: asyncio.Queue  # [DestinationWanted], FirstToken, then the PrefillResult; filled from the loop
    actor_loop: asyncio.AbstractEventLoop  # thread through the actor's event loop
    destination_asked: bool = False
    scheduled_at: float = 0.0
    sampled_at: float = 0.0
    transfer_open: bool = False
    transfer_opened_at: float = 0.0
    transfer_bytes: int = 0
    cache_since: int | None = None  # the asking router's cache cursor: its result carries the changes after it


class PrefillWorker:
    def __init__(self, worker_id: str, config: EngineConfig, kv_config: KVTransferConfig) -> None:
        self.worker_id = worker_id
        self.engine = LLMEngine(config)
        self.node_id, self.node_ip = node_identity()
        self.sender = create_sender(kv_config, worker_id, self.engine.kv_cache, self.node_ip)
        self.jobs: dict[str, _Job] = {}
        # a prompt sent without its decode reservation asks for one once this many of its tokens are left:
        # two steps' worth, so it lands before the step that computes the last chunk (and ships the KV)
        sched = config.scheduler
        step = (sched.prefill_chunk_tokens if sched.prefill_order == "fair" else 0) or sched.max_num_batched_tokens
        self.destination_horizon = 2 * min(step, sched.max_num_batched_tokens)
        self.loop = EngineLoop(self.engine, self._on_step, poll=self._poll, layer_hook_for=self._hook_for,
                               on_fail=self._fail_transfers, name=f"{worker_id}-loop")
        self.loop.start()

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, PoolKind.PREFILL, self.node_id, self.node_ip,
                          self.engine.cache_spec.block_size, self.engine.allocator.num_blocks, pid=os.getpid(),
                          kv_bytes_per_token=self.engine.cache_spec.bytes_per_block // self.engine.cache_spec.block_size,
                          destination_horizon_tokens=self.destination_horizon)

    async def ping(self) -> Heartbeat:
        return Heartbeat(self.worker_id, time.monotonic() - self.loop.last_progress, self.loop.busy,
                         self.loop.alive)

    async def report(self, since: int = -1) -> LoadReport:
        """Load, and the prefix-cache changes after change number `since` (see `CacheEventLog`)."""
        return await asyncio.wrap_future(self.loop.call(lambda: self.engine.load_report(self.worker_id, since)))

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      reservation: Reservation | None, cache_since: int | None = None
                      ) -> AsyncIterator[DestinationWanted | FirstToken | PrefillResult]:
        """Compute the prompt and push its KV into `reservation`: yields the first token as soon as it is
        sampled, then the outcome once the KV landed (a failure yields only the outcome). The outcome's load
        report carries the prefix-cache changes after `cache_since` (the asking router's cursor), so its
        index holds the prompt's blocks before its next placement.

        `reservation` None: the decode blocks are not reserved yet. Every chunk but the last is computed
        meanwhile; once `destination_horizon` tokens are left, it yields `DestinationWanted`, and the last
        chunk waits for `set_destination`."""
        outbox: asyncio.Queue = asyncio.Queue()
        actor_loop = asyncio.get_running_loop()

        def add() -> None:
            if request_id in self.jobs:
                raise ValueError(f"request {request_id!r} is already prefilling on {self.worker_id}")
            req = Request(request_id, prompt_token_ids, params, self.engine.cache_spec.block_size,
                          self.engine.eos_token_ids, self.engine.max_model_len, prefill_only=True,
                          awaiting_destination=reservation is None)
            self.engine.scheduler.add(req)
            job = self.jobs[request_id] = _Job(req, None, [], 0, outbox, actor_loop, cache_since=cache_since)
            if reservation is not None:
                self._set_destination(job, reservation)
            self._ask_destinations()

        await asyncio.wrap_future(self.loop.call(add))
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
            return True

        return await asyncio.wrap_future(self.loop.call(set_))

    async def describe(self) -> dict:
        """What this worker holds right now (for debugging and operators)."""

        def describe() -> dict:
            return {"jobs": {rid: {"status": j.request.status.name, "transfer_open": j.transfer_open,
                                   "transfer": self.sender.poll(rid).name if j.transfer_open else None}
                             for rid, j in self.jobs.items()},
                    "requests": {rid: r.status.name for rid, r in self.engine.scheduler.requests.items()}}

        return await asyncio.wrap_future(self.loop.call(describe))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds (benchmarks measure cold prefills with it)."""
        await asyncio.wrap_future(self.loop.call(self.engine.allocator.reset_cache))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self.loop.call(lambda: self._end(request_id, "aborted by the router")))

    async def release_router(self, router_id: str, final: bool = True) -> int:
        """End the prompts router replica `router_id`'s attempts have here (it is gone, or, not `final`, it
        lost touch with this worker and starts over). Returns how many."""

        def release() -> int:
            keys = [k for k in self.jobs if owner_of(k) == router_id]
            for key in keys:
                self._end(key, f"router replica {router_id} is gone")
            return len(keys)

        return await asyncio.wrap_future(self.loop.call(release))

    async def shutdown(self) -> EngineLoad:
        """Stop; returns the load it stopped with (a drained worker's shows it held nothing)."""
        load = await asyncio.wrap_future(self.loop.call(self.engine.load))
        self.loop.shutdown()
        self.sender.close()
        return load

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
            if chunk.end == job.request.num_prompt_tokens and self._open_transfer(job):
                sending.append(job.request.request_id)
        if not sending:
            return None

        def hook(layer: int) -> None:
            # NOTE: the deadline measures progress, not wall time: a slow step (a long last chunk on a busy
            # machine) keeps its transfer alive as long as layers keep coming
            until = time.monotonic() + KV_TRANSFER_TIMEOUT_S
            for rid in sending:
                self.sender.extend(rid, until)
                self.sender.send_layer(rid, layer)

        return hook

    def _open_transfer(self, job: _Job) -> bool:
        req = job.request
        skip = job.num_dst_cached_blocks
        n = cdiv(req.num_prompt_tokens, self.engine.cache_spec.block_size)
        if skip >= n:
            return False  # the decode worker holds the whole prompt already
        # NOTE: the whole prompt's blocks go in the last chunk's step, earlier chunks included: they are
        # final by then, and one transfer per request keeps the receiver's bookkeeping trivial.
        self.sender.begin(req.request_id, job.dst, req.block_ids[skip:n], job.dst_block_ids[skip:n],
                          time.monotonic() + KV_TRANSFER_TIMEOUT_S)
        job.transfer_open = True
        job.transfer_opened_at = time.time()
        job.transfer_bytes = (n - skip) * self.engine.cache_spec.bytes_per_block
        return True

    def _fail_transfers(self, requests: list[Request]) -> None:
        """A failed step ends these requests: fail their transfers before their blocks are freed."""
        for r in requests:
            job = self.jobs.get(r.request_id)
            if job is not None and job.transfer_open:
                self.sender.abort(r.request_id, "the prefill worker's engine step failed")
                job.transfer_open = False

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
            _put(job, FirstToken(req.request_id, req.output_token_ids[0],
                                 None if stop is None else FINISH_REASONS[stop], req.num_cached_tokens,
                                 job.scheduled_at, job.sampled_at, req.prefill_compute_s))
            if not job.transfer_open:  # nothing to send: done as soon as sampled
                self._finish(job, None)

    @staticmethod
    def _set_destination(job: _Job, reservation: Reservation) -> None:
        job.dst, job.dst_block_ids = reservation.kv_address, reservation.block_ids
        job.num_dst_cached_blocks = reservation.num_cached_blocks
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
        return any(j.transfer_open for j in self.jobs.values())

    def _finish(self, job: _Job, transfer: TransferResult | None) -> None:
        req = job.request
        del self.jobs[req.request_id]
        error = None if transfer is None or transfer.ok else f"KV transfer failed: {transfer.error}"
        first = req.output_token_ids[0] if req.output_token_ids else None
        if error is None and first is None:
            error = "KV transfer finished before the first token was sampled"
        stop = req.check_stop() if first is not None else None
        # the worker is done with the request either way; its full blocks stay in the prefix cache
        self.engine.scheduler.finish(req, RequestStatus.FINISHED_ERROR if error else
                                     (stop or RequestStatus.FINISHED_LENGTH))
        now = time.time()
        result = PrefillResult(req.request_id, first, None if stop is None else FINISH_REASONS[stop],
                               req.num_cached_tokens, error, job.scheduled_at, job.sampled_at, now,
                               now - job.transfer_opened_at if job.transfer_open else 0.0,
                               job.transfer_bytes, transfer is not None and not transfer.ok,
                               self.engine.load_report(self.worker_id, job.cache_since))
        _put(job, result)

    def _end(self, request_id: str, reason: str) -> None:
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        if job.transfer_open:
            self.sender.abort(request_id, reason)
        self.engine.scheduler.finish(job.request, RequestStatus.FINISHED_ABORTED)
        _put(job, PrefillResult(request_id, None, None, job.request.num_cached_tokens, reason,
                                       report=self._report()))

    def _report(self) -> LoadReport:
        # NOTE: only the newest cache change's number: the router reads the changes themselves from its own
        # cursor (`report`), since other router replicas read this worker's cache too
        return self.engine.load_report(self.worker_id, None)


def _put(job: _Job, item: DestinationWanted | FirstToken | PrefillResult) -> None:
    """Hand a job's message to its `prefill` stream, from the loop thread."""
    job.actor_loop.call_soon_threadsafe(job.outbox.put_nowait, item)
