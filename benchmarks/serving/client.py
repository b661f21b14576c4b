"""Drive one load against a pdserve server over gRPC, recording when each streamed message arrived.

Everything is timed here, on the client, with `time.perf_counter()`: TTFT is the first message carrying a
token minus the send time, each later message adds inter-token gaps, end-to-end is the last message minus
the send time. A message with k tokens (the server sends one per decode step, so k is 1 unless a step is
merged) counts as k gaps of 1/k of its interval, as vLLM's benchmark does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
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


@dataclass
class RunResult:
    """One load's records, in workload order (requests never sent are absent)."""

    load: Load
    records: list[RequestRecord]
    started_at: float
    finished_at: float  # the last request's end (or when the client gave up on the stragglers)

    @property
    def duration_s(self) -> float:
        return max(self.finished_at - self.started_at, 1e-9)


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
        if record.done_at is None:
            record.error = "stream ended without a finish_reason"
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    except asyncio.CancelledError:
        call.cancel()
        record.error = "cancelled: still running when the drain timeout passed"
        raise


async def run_load(stub: pb_grpc.GenerationStub, specs: Sequence[RequestSpec], load: Load, *,
                   id_prefix: str = "bench", request_timeout_s: float = 600.0, drain_timeout_s: float = 300.0,
                   progress: bool = False, desc: str = "") -> RunResult:
    """Send `specs` (at most `load.num_requests` of them) under `load` and wait for their answers.

    Requests still streaming `drain_timeout_s` after the last one was sent are cancelled and recorded with
    an error; they count as sent, not completed.
    """
    specs = list(specs[:load.num_requests])
    offsets = load.arrival_offsets() if load.open_loop else []
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    bar = _progress_bar(len(offsets) if load.open_loop else len(specs), desc, progress)

    def start(i: int) -> asyncio.Task:
        spec = specs[i]
        rec = RequestRecord(i, spec.kind, spec.num_prompt_tokens, spec.max_tokens)
        records.append(rec)
        task = asyncio.ensure_future(send_one(stub, spec, rec, f"{id_prefix}-{i}", request_timeout_s))
        task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
        return task

    t0 = time.perf_counter()
    deadline = t0 + load.duration_s if load.duration_s is not None else float("inf")
    if load.open_loop:
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            start(i)
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (set(), set())
    else:
        next_index = iter(range(len(specs)))

        async def user() -> None:
            for i in next_index:  # shared: each user takes the next request in workload order
                if time.perf_counter() > deadline:
                    return
                await start(i)

        users = [asyncio.ensure_future(user()) for _ in range(load.concurrency)]
        limit = None if load.duration_s is None else load.duration_s + drain_timeout_s
        _, pending = await asyncio.wait(users, timeout=limit)
    for t in pending:  # cancelling a user cancels the request it waits on
        t.cancel()
    await asyncio.gather(*tasks, *pending, return_exceptions=True)
    bar.close()
    ends = [r.done_at for r in records if r.done_at is not None]
    return RunResult(load, sorted(records, key=lambda r: r.index), t0, max(ends, default=time.perf_counter()))


def _progress_bar(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)
