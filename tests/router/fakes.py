"""In-process fake workers for the router's lifecycle tests: no Ray, no model, milliseconds per test.

A fake worker keeps the books a real one keeps — blocks held per attempt key, reservations, running
sequences — and "computes" with a toy model whose next token is a pure function of the sequence so far
(`next_token`), so a request migrated mid-stream must produce exactly the tokens of an undisturbed run.
Tests kill (`die`), stall (`stall`) or script failures into it and read what the router did.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.block_allocator import BlockAllocator
from engine.config import cdiv
from engine.sampling_params import SamplingParams
from protocol import FinishReason, PoolKind
from protocol.messages import (
    DestinationWanted,
    EngineLoad,
    FirstToken,
    Heartbeat,
    KVMoveResult,
    LoadReport,
    PrefillResult,
    Reservation,
    StepOutput,
    TokenDelta,
    WorkerInfo,
    owner_of,
)
from router.registry import WorkerRegistry, make_worker
from router.router import Router, RouterConfig
from router.validation import ValidatedRequest
from router.worker_client import Failure, WorkerClient, WorkerError

BLOCK = 4


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq)) % 997 + 3


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeWorker(WorkerClient):
    def __init__(self, worker_id: str, kind: PoolKind, num_blocks: int = 64, node: str = "node-0",
                 step_s: float = 0.002) -> None:
        self.worker_id = worker_id
        self.kind = kind
        self.num_blocks = num_blocks
        self.node = node
        self.step_s = step_s
        self.held: dict[str, int] = {}  # attempt key -> blocks
        self.reserved: dict[str, tuple[list[int], int]] = {}  # decode: key -> (prompt, max_tokens)
        self.running: dict[str, tuple[list[int], int]] = {}  # key -> (sequence, tokens left)
        self.keys: list[str] = []  # every key this worker was asked about, in order
        self.renewed: list[str] = []
        self.paused: set[str] = set()
        self.held_keys: set[str] = set()  # held for a drain's move: never resumed
        self.produced: dict[str, int] = {}  # key -> tokens this worker produced for it
        self.peers: dict[str, FakeWorker] = {}  # the cluster's workers, for KV moves
        self.moved_out: list[tuple[str, str]] = []  # (key, dst key) of every KV move sent
        self.fail_next_move = False
        self.corrupt_next_check = False  # decode: the next kv_digest answers other bytes than were sent
        self.forgotten: list[tuple[str, int]] = []  # decode: (key, start) of every forget_kv
        self.connected: list = []  # the peers a drain warmed links to
        self.flow: list[tuple[str, str]] = []  # ("pause" | "resume", key), in order
        self.dead = False
        self.killed = False
        self.running_gate = asyncio.Event()
        self.running_gate.set()  # cleared: the worker is stalled (SIGSTOP)
        self.prefill_gate = asyncio.Event()
        self.prefill_gate.set()  # cleared: prefills wait (a long prompt, a deep queue)
        self.prefill_started = asyncio.Event()
        self.kv_gate = asyncio.Event()
        self.kv_gate.set()  # cleared: the first token is out, the KV transfer takes its time
        self.reserve_gate = asyncio.Event()
        self.reserve_gate.set()  # cleared: reservations take their time
        self.fail_next_resume = False
        self.stream_failure: Failure | None = None  # set: the step stream breaks with this failure
        self.fail_next_prefill: str | None = None  # "kv" | "error": the next prefill answers with this failure
        self.lapse_next_start = False
        self.error_next_step = False
        self.reserve_full = False
        # set: a prompt longer than this may come with no reservation (`DestinationWanted`, `set_destination`)
        self.destination_horizon_tokens: int | None = None
        self.destinations: dict[str, asyncio.Future] = {}  # key -> set by set_destination
        self.destinations_set: list[tuple[str, Reservation]] = []
        self.reserve_calls: list[str] = []  # keys whose reserve call got past the process's door
        self._outbox: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._loop_task: asyncio.Task | None = None
        self.cache: BlockAllocator | None = None  # set: `report` reads its prefix-cache change log

    # -- test controls --------------------------------------------------------------------------------

    def die(self) -> None:
        self.dead = True
        self.held.clear()  # a dead process holds nothing
        self.running.clear()
        self.reserved.clear()
        self.running_gate.set()
        self.prefill_gate.set()
        self.kv_gate.set()
        self.reserve_gate.set()
        for waiting in self.destinations.values():
            if not waiting.done():
                waiting.set_result(None)
        self._outbox.put_nowait(None)

    def stall(self) -> None:
        self.running_gate.clear()

    @property
    def blocks_in_use(self) -> int:
        return sum(self.held.values())

    # -- WorkerClient ---------------------------------------------------------------------------------

    async def _enter(self) -> None:
        if self.dead:
            raise WorkerError(self.worker_id, "actor died", Failure.LOST)
        await self.running_gate.wait()
        if self.dead:
            raise WorkerError(self.worker_id, "actor died", Failure.LOST)

    async def _timed(self, coro, timeout: float):
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError as e:
            raise WorkerError(self.worker_id, f"no answer within {timeout}s", Failure.TIMEOUT) from e

    def describe(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.kind, self.node, "127.0.0.1", BLOCK, self.num_blocks,
                          kv_address=self.worker_id, destination_horizon_tokens=self.destination_horizon_tokens)

    async def info(self) -> WorkerInfo:
        return self.describe()

    async def ping(self, timeout: float) -> Heartbeat:
        await self._timed(self._enter(), timeout)
        return Heartbeat(self.worker_id, 0.0, bool(self.running), True)

    async def report(self, since: int, timeout: float) -> LoadReport:
        await self._timed(self._enter(), timeout)
        if self.cache is None:
            return LoadReport(self.worker_id, self._load())
        c = self.cache.changes_since(since)
        return LoadReport(self.worker_id, self._load(), c.stored, c.removed, c.since, c.seq, c.full)

    def _load(self) -> EngineLoad:
        free = self.num_blocks - self.blocks_in_use
        return EngineLoad(len(self.running), 0, 0, free, self.num_blocks, 0)

    async def reserve(self, key, prompt, params, src, timeout):
        # NOTE: shielded: like a Ray call, the worker finishes it even when the caller gives up on it
        return await asyncio.shield(self._reserve(key, prompt, params, src, timeout))

    async def _reserve(self, key, prompt, params, src, timeout):
        await self._timed(self._enter(), timeout)
        self.reserve_calls.append(key)  # (in flight from here)
        await self.reserve_gate.wait()
        await self._enter()  # (a call in flight when the process dies fails, as Ray's does)
        self.keys.append(key)
        assert key not in self.held, f"{key} reserved twice on {self.worker_id}"
        need = cdiv(len(prompt), BLOCK)
        if self.reserve_full or need > self.num_blocks - self.blocks_in_use:
            return None
        self.held[key] = need
        self.reserved[key] = (list(prompt), params.max_tokens)
        return Reservation(self.worker_id, list(range(need)), 0, 30.0)

    async def renew(self, keys, timeout):
        await self._timed(self._enter(), timeout)
        self.renewed += keys
        return [k for k in keys if k not in self.reserved]

    async def prefill(self, key, prompt, params: SamplingParams, reservation, cache_since=None, verify_kv=False):
        await self._enter()
        self.keys.append(key)
        self.held[key] = cdiv(len(prompt), BLOCK)
        self.prefill_started.set()
        await self.prefill_gate.wait()
        await self._enter()
        if reservation is None:  # every chunk but the last is computed; the last waits for its destination
            assert self.destination_horizon_tokens, "a prompt with no reservation, to a worker that wants one"
            self.destinations[key] = asyncio.get_running_loop().create_future()
            yield DestinationWanted(key)
            await self.destinations[key]
            await asyncio.sleep(self.step_s)  # the last chunk's step
            await self._enter()
        failure, self.fail_next_prefill = self.fail_next_prefill, None
        if failure == "error":  # the step failed: no token
            self.held.pop(key, None)
            yield PrefillResult(key, None, None, 0, "injected error failure")
            return
        token = next_token(prompt)
        finish = FinishReason.LENGTH if params.max_tokens == 1 else None
        yield FirstToken(key, token, finish, 0, scheduled_at=1.0, sampled_at=1.0)
        await self.kv_gate.wait()  # the KV is still on its way
        await self._enter()
        self.held.pop(key, None)
        if failure == "kv":
            yield PrefillResult(key, None, None, 0, "injected kv failure", kv_failed=True)
            return
        # the fake's "KV" is the prompt itself; the blocks the destination cached were not sent
        start = reservation.num_cached_blocks * BLOCK if reservation is not None else 0
        digest = str(hash(tuple(prompt[start:]))) if verify_kv else None
        yield PrefillResult(key, token, finish, 0, scheduled_at=1.0, sampled_at=1.0, kv_done_at=1.0,
                            kv_digest=digest)

    async def set_destination(self, key, reservation, timeout):
        await self._timed(self._enter(), timeout)
        waiting = self.destinations.get(key)
        if waiting is None or waiting.done() or key not in self.held:
            return False
        self.destinations_set.append((key, reservation))
        waiting.set_result(reservation)
        return True

    async def start(self, key, first_token, timeout):
        await self._timed(self._enter(), timeout)
        reserved = self.reserved.pop(key, None)
        if reserved is None or self.lapse_next_start:
            self.lapse_next_start = False
            self.held.pop(key, None)
            return False
        prompt, max_tokens = reserved
        self.running[key] = (prompt + [first_token], max_tokens - 1)
        self.produced[key] = 1
        self._ensure_loop()
        return True

    async def submit(self, key, prompt, params, timeout):
        await self._timed(self._enter(), timeout)
        self.keys.append(key)
        self.held[key] = cdiv(len(prompt), BLOCK)
        self.running[key] = (list(prompt), params.max_tokens)
        self.produced[key] = 0
        self._ensure_loop()

    async def abort(self, key, timeout):
        await self._timed(self._enter(), timeout)
        self.held.pop(key, None)
        self.reserved.pop(key, None)
        self.running.pop(key, None)
        self.held_keys.discard(key)

    async def release_router(self, router_id, timeout, final=True):
        keys = [k for k in {*self.held, *self.reserved, *self.running} if owner_of(k) == router_id]
        for key in keys:
            await self.abort(key, timeout)
        return len(keys)

    async def pause(self, key, timeout):
        await self._timed(self._enter(), timeout)
        self.paused.add(key)
        self.flow.append(("pause", key))

    async def resume(self, key, timeout):
        await self._timed(self._enter(), timeout)
        if self.fail_next_resume:
            self.fail_next_resume = False
            raise WorkerError(self.worker_id, "unavailable: connection reset", Failure.UNAVAILABLE)
        if key not in self.held_keys:
            self.paused.discard(key)
        self.flow.append(("resume", key))

    async def hold(self, key, timeout):
        await self._timed(self._enter(), timeout)
        if key not in self.running:
            return None
        self.paused.add(key)
        self.held_keys.add(key)
        return self.produced[key]

    async def connect(self, peers, timeout):
        await self._timed(self._enter(), timeout)
        self.connected += peers

    async def send_kv(self, key, dst_key, reservation, timeout):
        await self._timed(self._enter(), timeout)
        assert key in self.held_keys, f"send_kv of {key}, which is not held on {self.worker_id}"
        seq, _ = self.running[key]
        dst = self.peers[reservation.kv_address]
        if self.fail_next_move or dst.dead:
            self.fail_next_move = False
            return KVMoveResult(False, error="injected KV move failure")
        # the fake's "KV" is the sequence itself: the destination's prompt must be all of it but the last token
        assert dst.reserved[dst_key][0] == seq[:-1], "the KV moved does not match the destination's prompt"
        self.moved_out.append((key, dst_key))
        return KVMoveResult(True, num_bytes=len(seq) - 1, seconds=0.001)

    async def kv_digest(self, key, num_tokens, start, timeout):
        await self._timed(self._enter(), timeout)
        seq, _ = self.running[key]
        if self.corrupt_next_check:
            self.corrupt_next_check = False
            return "other bytes"
        return str(hash(tuple(seq[start:num_tokens])))

    async def forget_kv(self, key, start, timeout):
        await self._timed(self._enter(), timeout)
        self.forgotten.append((key, start))
        return True

    async def steps(self) -> AsyncIterator[StepOutput]:
        while True:
            out = await self._outbox.get()
            if out is None:
                raise WorkerError(self.worker_id, "step stream ended: actor died", Failure.LOST)
            if self.stream_failure is not None:
                raise WorkerError(self.worker_id, "step stream interrupted", self.stream_failure)
            yield out

    async def shutdown(self, timeout):
        load = self._load()
        self.die()
        return load

    def kill(self) -> None:
        self.killed = True
        self.die()

    # -- the toy engine -------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._step_loop())

    async def _step_loop(self) -> None:
        while not self.dead:
            await asyncio.sleep(self.step_s)
            await self.running_gate.wait()
            if self.dead or not self.running:
                continue
            deltas = []
            for key, (seq, left) in list(self.running.items()):
                if key in self.paused:
                    continue
                if self.error_next_step:
                    deltas.append(TokenDelta(key, [], FinishReason.ERROR, error="injected step failure"))
                    self.running.pop(key)
                    self.held.pop(key, None)
                    continue
                tok = next_token(seq)
                seq.append(tok)
                self.produced[key] += 1
                left -= 1
                done = left == 0
                deltas.append(TokenDelta(key, [tok], FinishReason.LENGTH if done else None))
                if done:
                    self.running.pop(key)
                    self.held.pop(key, None)
                else:
                    self.running[key] = (seq, left)
            self.error_next_step = False
            self._outbox.put_nowait(StepOutput(1, 0.0, deltas, self._load()))


class FakeCluster:
    """A router over fake workers: `prefill-i`, `decode-i` (or `colocated-i`)."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, num_colocated: int = 0, horizon: int = 0,
                 **config) -> None:
        """`horizon`: the prefill workers' `destination_horizon_tokens` (0: they want every reservation up
        front, so the router reserves at placement)."""
        config.setdefault("block_size", BLOCK)
        config.setdefault("admission_timeout_s", 5.0)
        config.setdefault("call_timeout_s", 1.0)
        # NOTE: the lifecycle tests follow the remote path (prefill pool + KV transfer); test_path.py and the
        # local-path tests turn local prefills on
        config.setdefault("local_prefill", False)
        self.registry = WorkerRegistry()
        self.router = Router(RouterConfig(**config), self.registry)
        self.workers: dict[str, FakeWorker] = {}
        for kind, n in ((PoolKind.PREFILL, num_prefill), (PoolKind.DECODE, num_decode),
                        (PoolKind.COLOCATED, num_colocated)):
            for i in range(n):
                fake = FakeWorker(f"{kind.value}-{i}", kind)
                if kind is PoolKind.PREFILL:
                    fake.destination_horizon_tokens = horizon or None
                self.add(fake)

    def add(self, fake: FakeWorker) -> None:
        self.workers[fake.worker_id] = fake
        fake.peers = self.workers
        self.registry.add(make_worker(fake.describe(), fake))

    def __getitem__(self, worker_id: str) -> FakeWorker:
        return self.workers[worker_id]

    def kill(self, worker_id: str, noticed: bool = True) -> None:
        """The process dies. `noticed`: liveness (or a decode worker's stream ending) has told the registry,
        as it would within a heartbeat; otherwise only the failing calls tell the router."""
        self.workers[worker_id].die()
        if noticed:
            self.registry.lose(self.registry.get(worker_id), "SIGKILL")

    def request(self, rid: str, prompt: list[int], max_tokens: int) -> ValidatedRequest:
        return ValidatedRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), ())

    async def collect(self, req: ValidatedRequest, on_event=None) -> tuple[list[int], str | None, object]:
        """Run one request to its end; returns (tokens, finish reason, final state)."""
        tokens: list[int] = []
        finish = state = None
        async for event, state in self.router.generate(req):
            tokens += event.token_ids
            finish = event.finish_reason
            if on_event is not None:
                await on_event(len(tokens), state)
        return tokens, finish, state

    def blocks_in_use(self) -> dict[str, int]:
        return {wid: w.blocks_in_use for wid, w in self.workers.items() if not w.dead}

    async def settle(self) -> None:
        """Let spawned aborts and step loops run."""
        for _ in range(20):
            await asyncio.sleep(0.005)


async def until(cond, timeout: float = 5.0) -> None:
    """Wait until `cond()` holds, polling every 10 ms; AssertionError past `timeout`."""
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")
