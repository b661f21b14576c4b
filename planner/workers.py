"""A simulated worker: the engine's step loop, priced by a profile.

Each step is planned when the previous one ends, like the engine's `schedule()`:
- decode rows first: every running sequence gets one token a step (continuous batching); sequences whose
  KV landed since the last step join at this one;
- then prompts in fair order (`engine.scheduler`'s rule: fewest uncomputed tokens first, each lowered by
  `aging_tokens_per_step` for every step it waited), all of them together at most `prefill_chunk_tokens`
  (chunked prefill), within what `max_num_batched_tokens` leaves.

A prefill worker computes prompts only, a decode worker decodes only (local prefill is not simulated), a
colocated worker does both in one step. Time is the simulator's: a step's duration comes from the profile.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from planner.profile import Profile
from planner.trace import TraceRequest
from protocol.block_hash import BlockHash
from protocol.kinds import PoolKind
from router.placement import WorkerLoad


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Phase(IntEnum):
    """A simulated request's life, in order."""

    QUEUED = 0  # at the router, waiting for a decode worker with room
    PREFILLING = 1  # on its prefill worker, queued or computing chunks
    SENDING_KV = 2  # first token out; its KV on the way to the decode worker
    DECODING = 3
    FINISHED = 4


@dataclass(eq=False)
class SimRequest:
    """One request as the simulation carries it."""

    index: int  # position in the trace
    spec: TraceRequest
    hashes: tuple[BlockHash, ...]  # its shared prefix's block hashes (what a prefix cache can match)
    phase: Phase = Phase.QUEUED
    prefill: SimWorker | None = None
    decode: SimWorker | None = None
    computed: int = 0  # prompt tokens computed or cached on its prefill worker
    enqueued_step: int = 0  # its prefill worker's step count when it arrived there (fair order's aging)
    blocks: int = 0  # KV blocks held on its decode worker
    first_token_s: float | None = None  # when its first token was sampled
    kv_ready_s: float | None = None
    finish_s: float | None = None
    join_step: int = 0  # its decode worker's step that gave its second token
    context: int = 0  # tokens it attends to while decoding (prompt + generated)
    cached_tokens: int = 0

    @property
    def remaining_prompt(self) -> int:
        return self.spec.prompt_len - self.computed


@dataclass(frozen=True)
class Step:
    """What one engine step computes, and how long it takes."""

    chunks: tuple[tuple[SimRequest, int], ...]  # (prompt, tokens this step)
    decode_rows: int  # sequences decoding this step
    duration_s: float


@dataclass
class StepOutcome:
    """What a finished step produced."""

    prompts_done: list[SimRequest] = field(default_factory=list)  # first token sampled at this step's end
    chunk_pushes: list[tuple[SimRequest, int]] = field(default_factory=list)  # KV to ship: (prompt, tokens)
    finished: list[SimRequest] = field(default_factory=list)  # produced their last token
    gaps: list[tuple[float, int]] = field(default_factory=list)  # inter-token gaps: (seconds, how many)


class SimWorker:
    """One worker of a pool. Its load snapshot (`load()`) is what the router's placement functions see."""

    def __init__(self, worker_id: str, pool: PoolKind, profile: Profile) -> None:
        self.worker_id, self.pool, self.profile = worker_id, pool, profile
        self.engine = profile.engine
        self.prompts: list[SimRequest] = []  # queued or prefilling here
        self.joining: list[SimRequest] = []  # KV landed: decode from the next step
        self.running: list[tuple[int, int, SimRequest]] = []  # heap of (last step, index, request)
        self.context_tokens = 0  # summed over the running sequences
        self.used_blocks = 0
        self.steps = 0
        self.step: Step | None = None  # the step in progress
        self.step_ends_at = 0.0  # when it ends (the simulation's clock)
        self.joined: list[SimRequest] = []  # the sequences the step in progress decodes for the first time
        self.inflight_prompt_tokens = 0  # placed here, not arrived yet (the router counts them: `Worker.snapshot`)
        self.last_step_end = 0.0
        self.busy_s = 0.0

    # -- what the router sees -----------------------------------------------------------------------

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(r.remaining_prompt for r in self.prompts) + self.inflight_prompt_tokens

    @property
    def num_decoding(self) -> int:
        return len(self.running) + len(self.joining)

    @property
    def free_blocks(self) -> int:
        return max(0, self.engine.num_blocks - self.used_blocks)

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, "node-0", self.pool, num_running=self.num_decoding + len(self.prompts),
                          queued_prefill_tokens=self.queued_prefill_tokens, free_blocks=self.free_blocks,
                          total_blocks=self.engine.num_blocks)

    # -- requests arriving ----------------------------------------------------------------------------

    def add_prompt(self, r: SimRequest, cached_tokens: int) -> None:
        r.prefill, r.phase = self, Phase.PREFILLING
        r.computed = r.cached_tokens = min(cached_tokens, r.spec.prompt_len - 1)  # its last token is computed
        r.enqueued_step = self.steps
        self.prompts.append(r)

    def reserve(self, r: SimRequest) -> None:
        """Hold the request's KV room here: its whole context, prompt and output."""
        r.decode = self
        r.blocks = cdiv(r.spec.prompt_len + r.spec.output_len, self.engine.block_size)
        self.used_blocks += r.blocks

    def add_decoding(self, r: SimRequest) -> None:
        """Its KV is here: it decodes from the next step."""
        r.phase = Phase.DECODING
        self.joining.append(r)

    # -- steps ---------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.prompts or self.joining or self.running)

    def plan_step(self, slowdown: Callable[[int | None], float] = lambda _prompt_tokens: 1.0) -> Step:
        """The next step (the engine's `schedule()`), its duration stretched by `slowdown` (shared cores):
        `slowdown(None)` for the step, `slowdown(prompt tokens)` for each prompt's chunk (a short prefill
        loses more to a neighbour than a long one, `Profile.interference_at`)."""
        assert self.step is None, f"{self.worker_id} planned a step while one runs"
        self.steps += 1
        self.joined = list(self.joining)
        for r in self.joining:
            r.join_step, r.context = self.steps, r.spec.prompt_len + 1
            self.context_tokens += r.context
            # its last token comes at step join_step + output_len - 2 (the first came from the prefill)
            heapq.heappush(self.running, (self.steps + r.spec.output_len - 2, r.index, r))
        self.joining.clear()
        # NOTE: every running sequence decodes each step; the batch is bounded by the KV room placement
        # checks, not by max_num_seqs (the engine would queue past it)
        rows = len(self.running)
        budget = min(self.engine.max_num_batched_tokens - rows, self.engine.prefill_chunk_tokens)
        chunks: list[tuple[SimRequest, int]] = []
        aging = self.engine.aging_tokens_per_step
        for r in sorted(self.prompts, key=lambda r: (r.remaining_prompt - aging * (self.steps - r.enqueued_step),
                                                     r.index)):
            if budget <= 0:
                break
            n = min(r.remaining_prompt, budget)
            chunks.append((r, n))
            budget -= n
        prefill = sum(self.profile.prefill.chunk_s(n, r.computed) * slowdown(r.spec.prompt_len)
                      for r, n in chunks)
        base = self.profile.decode.step(rows, self.context_tokens) if rows else self.profile.prefill.step_s
        self.step = Step(tuple(chunks), rows, base * slowdown(None) + prefill)
        return self.step

    def end_step(self, now: float) -> StepOutcome:
        """Apply the step in progress, which ends at `now`."""
        step, self.step = self.step, None
        assert step is not None, f"{self.worker_id} ended a step it never planned"
        self.busy_s += step.duration_s
        out = StepOutcome()
        for r, n in step.chunks:
            r.computed += n
            out.chunk_pushes.append((r, n))
            if r.remaining_prompt == 0:
                self.prompts.remove(r)
                r.first_token_s = now
                out.prompts_done.append(r)
        if step.decode_rows:
            if step.decode_rows - len(self.joined):
                out.gaps.append((now - self.last_step_end, step.decode_rows - len(self.joined)))
            for r in self.joined:
                assert r.first_token_s is not None
                out.gaps.append((now - r.first_token_s, 1))
            self.context_tokens += step.decode_rows
            while self.running and self.running[0][0] <= self.steps:
                _, _, r = heapq.heappop(self.running)
                r.phase, r.finish_s = Phase.FINISHED, now
                self.context_tokens -= r.spec.prompt_len + r.spec.output_len
                out.finished.append(r)
        self.last_step_end = now
        return out

    def release(self, r: SimRequest) -> None:
        self.used_blocks -= r.blocks
        r.blocks = 0
