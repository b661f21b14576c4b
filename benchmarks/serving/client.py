"""Drive one load against a pdserve server over gRPC, recording when each streamed message arrived.

Everything is timed here, on the client, with `time.perf_counter()`: TTFT is the first message carrying a
token minus the send time, each later message adds inter-token gaps, end-to-end is the last message minus
the send time. A message with k tokens (the server sends one per decode step, so k is 1 unless a step is
merged) counts as k gaps of 1/k of its interval, as vLLM's benchmark does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from benchmarks.serving.load import Load
from benchmarks.serving.workloads import RequestSpec
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are `perf_counter()` seconds."""

    index: int  # position in the workload's request list
    kind: str
    num_prompt_tokens: int
    max_tokens: int
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # each output token's message arrival
    itls: list[float] = field(default_factory=list)  # gaps between consecutive tokens
    done_at: float | None = None  # the last message; None unless the stream ended normally
    finish_reason: str = ""
    cached_prompt_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    # the server's own TTFT breakdown (the last message's `timing`): queue, prefill, kv_transfer, first_decode
    stages: dict[str, float] = field(default_factory=dict)
    placement: str = ""  # where the prompt was prefilled: "remote" (the prefill pool), "local" (its decode worker)
    error: str | None = None  # gRPC status, or why the client gave up on it

    @property
    def ok(self) -> bool:
        return self.done_at is not None and self.error is None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.done_at - self.sent_at if self.done_at is not None else None

    @property
    def mean_itl(self) -> float | None:
        """The request's time per output token after the first (TPOT); None with fewer than 2 tokens."""
        return sum(self.itls) / len(self.itls) if self.itls else None

    def on_message(self, now: float, n: int) -> None:
        """A message with `n` tokens arrived at `now`."""
        if n == 0:
            return
        if self.token_times:
            self.itls.extend([(now - self.token_times[-1]) / n] * n)
        else:  # the first token; any others in the same message came with it
            self.itls.extend([0.0] * (n - 1))
        self.token_times.extend([now] * n)


CANCELLED = "cancelled"
StopRule = Callable[[Sequence[RequestRecord], int, float], bool]  # (records so far, planned, now) -> stop?


@dataclass
class RunResult:
    """One load's records, in workload order (requests never sent are absent)."""

    load: Load
    records: list[RequestRecord]
    duration_s: float  # the first send to the last answer (or to when the client gave up on the stragglers)
    stopped_early: bool = False  # `stop_when` ended it: requests still in flight were cancelled

    @classmethod
    def merge(cls, load: Load, parts: Sequence[RunResult]) -> RunResult:
        """Rounds of one run as one: their records, and their durations added."""
        records = sorted((r for p in parts for r in p.records), key=lambda r: r.index)
        return cls(load, records, sum(p.duration_s for p in parts), any(p.stopped_early for p in parts))


def to_request(spec: RequestSpec, request_id: str) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    req = pb.GenerateRequest(request_id=request_id, sampling=params)
    req.prompt_token_ids.ids.extend(spec.prompt_token_ids)
    return req


async def send_one(stub: pb_grpc.GenerationStub, spec: RequestSpec, record: RequestRecord, request_id: str,
                   timeout_s: float) -> None:
    """Stream one request into `record`; never raises (errors land in `record.error`)."""
    request = to_request(spec, request_id)
    record.sent_at = time.perf_counter()
    call = stub.Generate(request, timeout=timeout_s)
    try:
        async for msg in call:
            now = time.perf_counter()
            record.on_message(now, len(msg.token_ids))
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                record.done_at = now
                record.finish_reason = pb.FinishReason.Name(msg.finish_reason)
                record.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                record.prefill_worker, record.decode_worker = msg.prefill_worker_id, msg.decode_worker_id
                t = msg.timing
                record.stages = {"queue": t.queue_seconds, "prefill": t.prefill_seconds,
                                 "kv_transfer": t.kv_transfer_seconds, "first_decode": t.first_decode_step_seconds}
                record.placement = t.placement
        if record.done_at is None:
            record.error = "stream ended without a finish_reason"
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    except asyncio.CancelledError:
        call.cancel()
        record.error = CANCELLED
        raise


async def run_load(stub: pb_grpc.GenerationStub, specs: Sequence[RequestSpec], load: Load, *,
                   id_prefix: str = "bench", first_index: int = 0, request_timeout_s: float = 600.0, drain_timeout_s: float = 300.0,
                   stop_when: StopRule | None = None, progress: bool = False, desc: str = "") -> RunResult:
    """Send `specs` (at most `load.num_requests` of them) under `load` and wait for their answers.

    Requests still streaming `drain_timeout_s` after the last one was sent are cancelled and recorded with
    an error; they count as sent, not completed. Records are numbered from `first_index`. `stop_when`, polled 4 times a second, ends the run early
    (nothing more is sent, requests in flight are cancelled): a goodput probe that has already failed.
    """
    specs = list(specs[:load.num_requests])
    offsets = load.arrival_offsets() if load.open_loop else []
    planned = len(offsets) if load.open_loop else len(specs)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    stop = asyncio.Event()
    bar = _progress_bar(planned, desc, progress)

    def start(i: int) -> asyncio.Task:
        spec = specs[i]
        rec = RequestRecord(first_index + i, spec.kind, spec.num_prompt_tokens, spec.max_tokens)
        records.append(rec)
        # NOTE: a backend with its own `send_one` (the OpenAI one) sends; otherwise `stub` is a gRPC stub
        send = getattr(stub, "send_one", None)
        rid = f"{id_prefix}-{rec.index}"
        task = asyncio.ensure_future(send(spec, rec, rid, request_timeout_s) if send is not None
                                     else send_one(stub, spec, rec, rid, request_timeout_s))
        task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
        return task

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.25)
            if stop_when(records, planned, time.perf_counter()):
                stop.set()

    watcher = asyncio.ensure_future(watch()) if stop_when is not None else None
    t0 = time.perf_counter()
    deadline = t0 + load.duration_s if load.duration_s is not None else float("inf")
    if load.open_loop:
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0 and await _wait(stop, delay):
                break
            start(i)
        in_flight = asyncio.gather(*tasks, return_exceptions=True)
        await _wait(stop, drain_timeout_s, asyncio.shield(in_flight))
        pending = [t for t in tasks if not t.done()]
    else:
        next_index = iter(range(len(specs)))

        async def user() -> None:
            for i in next_index:  # shared: each user takes the next request in workload order
                if time.perf_counter() > deadline or stop.is_set():
                    return
                await start(i)

        users = asyncio.gather(*(user() for _ in range(load.concurrency)))
        limit = None if load.duration_s is None else load.duration_s + drain_timeout_s
        await _wait(stop, limit, asyncio.shield(users))
        pending = [t for t in tasks if not t.done()]
        users.cancel()
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if watcher is not None:
        watcher.cancel()
    bar.close()
    why = ("cancelled: the run had already failed (stop_when)" if stop.is_set()
           else "cancelled: still running when the drain timeout passed")
    for r in records:
        if r.error == CANCELLED:
            r.error = why
    end = max((r.done_at for r in records if r.done_at is not None), default=time.perf_counter())
    return RunResult(load, sorted(records, key=lambda r: r.index), max(end - t0, 1e-9), stop.is_set())


async def _wait(stop: asyncio.Event, timeout: float | None, work: asyncio.Future | None = None) -> bool:
    """Wait for `work` (or just `timeout` seconds) unless `stop` is set first; True if it was."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([waiter] if work is None else [waiter, work], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    return stop.is_set()


def _progress_bar(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)
