"""A discrete-event simulation of pdserve serving a trace on a layout, from a profile.

What it shares with the product, imported rather than copied so the two cannot drift:
- placement: `router.placement.choose_path` (joint: the (prefill, decode) pair with the lowest estimated
  time until the request decodes), `choose_prefill`/`choose_decode` for colocated pools;
- the estimates behind it: `router.cost_model.CostModel`, seeded with the profile's rates (what the router
  would have learned online) and the router's own `PrefixIndex` of what each worker caches;
- the bench's layouts (`benchmarks.serving.launch.Layout`) and workloads.

What it models (`planner.workers`): each worker's step loop (chunked prefill in fair order, continuous-batching
decode), KV pushed per chunk over the pair's link (a link carries one push at a time), late reservation
(a prompt longer than two steps of prompt tokens gets its decode blocks when its prefill is done; none free:
it waits there), the router's admission queue (no decode worker with room: wait), and, on a CPU profile,
workers sharing `shared_cores` cores (a step that starts while k workers compute takes k/cores as long,
or `interference` longer for each of the others, whichever is more: shared memory bandwidth, which costs a
short prompt's chunks more, `Profile.interference_at`; the router's
CPU for the tokens it relays comes off those cores), and a decode reservation made at placement waiting
for the decode worker's step in progress (the worker takes the call between steps) before the prefill starts.

What it leaves out: local prefill, speculative decoding, preemption, prefix-cache eviction, failures.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.serving.launch import Layout
from planner.profile import Profile
from planner.results import RequestResult, SimResult
from planner.trace import PrefixHashes, Trace
from planner.workers import Phase, SimRequest, SimWorker, cdiv
from protocol.kinds import PoolKind
from router.cost_model import CostModel, CostPriors
from router.placement import choose_decode, choose_path, choose_prefill
from router.prefix_index import PrefixIndex

# the batches a decode worker's step fit is seeded at (the router fits the line online from the same steps)
SEED_BATCHES = (1, 2, 4, 8, 16, 32)
SEED_CONTEXT_PER_SEQ = 256  # tokens of context per sequence the seeded steps assume


@dataclass(frozen=True)
class SimOptions:
    """How the simulated router behaves."""

    late_reservation: bool = True  # pdserve's default
    # NOTE: placement scores every (prefill, decode) pair: 64 x 64 pools make that 4,096 estimates a request.
    # Past this many workers a pool offers placement its least loaded ones (and every one caching the
    # prompt's prefix): what a pool that large would pick from anyway, and a 64-worker plan in seconds
    candidates: int = 8
    stop_after_s: float | None = None  # stop this long after the last arrival (unfinished requests miss)


def seeded_cost_model(profile: Profile, decode_ids: Sequence[str]) -> CostModel:
    """The router's cost model as it would stand after measuring these workers: the profile's prefill rate on
    a 512-token prompt, its link rate, and each decode worker's step fitted over a range of batches."""
    p, e = profile.prefill, profile.engine
    n, chunk = 512, e.prefill_chunk_tokens
    steps = cdiv(n, chunk)
    seconds = steps * p.step_s + sum(p.chunk_s(min(chunk, n - i * chunk), i * chunk) for i in range(steps))
    rate = profile.transfer.bytes_per_s
    cost = CostModel(profile.transfer.bytes_per_token,
                     CostPriors(prefill_tokens_per_s=n / seconds, same_node_bytes_per_s=rate,
                                cross_node_bytes_per_s=rate, decode_step_s=profile.decode.step(1, 0)))
    for wid in decode_ids:
        for b in SEED_BATCHES:
            cost.observe_step(wid, profile.decode.step(b, b * SEED_CONTEXT_PER_SEQ), b)
    return cost


class Simulation:
    """One run of a trace on a layout. `run()` once."""

    def __init__(self, profile: Profile, layout: Layout, trace: Trace, options: SimOptions = SimOptions()) -> None:
        self.profile, self.layout, self.trace, self.options = profile, layout, trace, options
        self.bs = profile.engine.block_size
        self.horizon = 2 * profile.engine.prefill_chunk_tokens  # `WorkerInfo.destination_horizon_tokens`

        def pool(kind: PoolKind, prefix: str, n: int) -> list[SimWorker]:
            return [SimWorker(f"{prefix}{i}", kind, profile) for i in range(n)]

        self.prefills = pool(PoolKind.PREFILL, "prefill-", layout.prefill_workers)
        self.decodes = pool(PoolKind.DECODE, "decode-", layout.decode_workers)
        self.colocated = pool(PoolKind.COLOCATED, "colocated-", layout.colocated_workers)
        if not self.colocated and not (self.prefills and self.decodes):
            raise ValueError(f"layout {layout.label}: needs prefill and decode workers, or colocated ones")
        self.by_id = {w.worker_id: w for w in self.prefills + self.decodes + self.colocated}
        self.cost = seeded_cost_model(profile, [w.worker_id for w in self.decodes + self.colocated])
        self.index = PrefixIndex()
        prefixes = PrefixHashes(self.bs)
        self.requests = [SimRequest(i, r, tuple(prefixes.of(r))) for i, r in enumerate(trace.requests)]
        self.waiting: list[SimRequest] = []  # at the router: no decode worker had room
        self.held: list[SimRequest] = []  # prefilled, waiting for decode room (late reservation)
        self.links: dict[tuple[str, str], float] = {}  # when each link is free again
        self.gaps: list[tuple[float, int]] = []
        self.computing = 0  # workers in a step now
        self.cores = self.worker_cores()
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    # -- the event loop -------------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self) -> SimResult:
        for r in self.requests:
            self.at(r.spec.arrival_s, lambda r=r: self.arrive(r))
        stop = (self.trace.duration_s + self.options.stop_after_s if self.options.stop_after_s is not None
                else float("inf"))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            if t > stop:
                break
            self.now = t
            fn()
        return self.result()

    # -- the router -----------------------------------------------------------------------------------

    def arrive(self, r: SimRequest) -> None:
        if not self.place(r):
            self.waiting.append(r)

    def retry_waiting(self) -> None:
        for r in list(self.held):
            if self.reserve_late(r):
                self.held.remove(r)
        for r in list(self.waiting):
            if self.place(r):
                self.waiting.remove(r)

    def _shortlist(self, pool: list[SimWorker], key: Callable[[SimWorker], tuple], keep: set[str]) -> list[SimWorker]:
        if len(pool) <= self.options.candidates:
            return pool
        best = sorted(pool, key=key)[:self.options.candidates]
        return best + [w for w in pool if w.worker_id in keep and w not in best]

    def place(self, r: SimRequest) -> bool:
        n, need = r.spec.prompt_len, cdiv(r.spec.prompt_len, self.bs)
        caching = set(self.index.match_all(r.hashes)) if r.hashes else set()
        if self.colocated:
            pool = self._shortlist(self.colocated, lambda w: (w.queued_prefill_tokens, w.num_decoding), caching)
            loads = [w.load() for w in pool]
            choice = choose_prefill(r.hashes, loads, self.index, self.bs, n)
            assert choice is not None
            wid = choose_decode(choice.node_id, need, loads, prefill_worker=choice.worker_id)
            if wid is None:
                return False
            self.by_id[wid].reserve(r)
            self.start_prefill(r, self.by_id[choice.worker_id], choice.cached_blocks)
            return True
        prefills = self._shortlist(self.prefills, lambda w: (w.queued_prefill_tokens, w.worker_id), caching)
        decodes = self._shortlist(self.decodes, lambda w: (-w.free_blocks, w.num_decoding, w.worker_id), set())
        options = choose_path(r.hashes, n, self.bs, [w.load() for w in prefills], [w.load() for w in decodes],
                              self.index, self.cost, need, local=False)
        if not options:
            return False
        best = options[0]
        assert best.prefill is not None, "local prefill is not simulated"
        decode = self.by_id[best.decode]
        r.decode = decode
        prefill = self.by_id[best.prefill]
        if self.options.late_reservation and n - best.prefill_cached_blocks * self.bs > self.horizon:
            self.start_prefill(r, prefill, best.prefill_cached_blocks)
            return True
        # NOTE: the router reserves before it sends the prompt, and the decode worker answers between its steps
        # (`EngineLoop`): the prefill starts once the step in progress there has ended
        decode.reserve(r)
        if decode.step is None:
            self.start_prefill(r, prefill, best.prefill_cached_blocks)
            return True
        tokens = n - best.prefill_cached_blocks * self.bs
        prefill.inflight_prompt_tokens += tokens

        def arrived() -> None:
            prefill.inflight_prompt_tokens -= tokens
            self.start_prefill(r, prefill, best.prefill_cached_blocks)

        self.at(decode.step_ends_at, arrived)
        return True

    def reserve_late(self, r: SimRequest) -> bool:
        """Decode room for a prefilled prompt that was placed without it: its chosen worker, else any."""
        assert r.decode is not None
        need = cdiv(r.spec.prompt_len + r.spec.output_len, self.bs)
        if r.decode.free_blocks < need:
            wid = choose_decode("node-0", need, [w.load() for w in self.decodes])
            if wid is None:
                return False
            r.decode = self.by_id[wid]
        r.decode.reserve(r)
        self.ship(r, r.spec.prompt_len - r.cached_tokens)  # its KV waited on the prefill worker
        return True

    def start_prefill(self, r: SimRequest, worker: SimWorker, cached_blocks: int) -> None:
        worker.add_prompt(r, cached_blocks * self.bs)
        self.start_step(worker)

    # -- workers --------------------------------------------------------------------------------------

    def start_step(self, w: SimWorker) -> None:
        if w.step is not None or not w.has_work:
            return
        self.computing += 1
        step = w.plan_step(self.slowdown)
        w.step_ends_at = self.now + step.duration_s
        self.at(w.step_ends_at, lambda: self.end_step(w))

    def worker_cores(self) -> float | None:
        """The cores the workers share, less what the router takes relaying the trace's tokens (on a shared
        machine it runs beside them: `router.token_s` of CPU a token, measured by the profile)."""
        cores = self.profile.shared_cores
        if not cores:
            return None
        span = max(1.0, self.trace.duration_s)
        router = self.profile.router.token_s * sum(r.output_len for r in self.trace.requests) / span
        return max(0.5, cores - router)

    def slowdown(self, prompt_tokens: int | None = None) -> float:
        """How much longer a step starting now takes for the workers computing beside it: their share of the
        cores, and their interference (the profile's; for a prompt's chunk, at that prompt's length)."""
        cores, k = self.cores, self.computing
        if not cores:
            return 1.0
        p = self.profile
        i = p.interference if prompt_tokens is None else p.interference_at(prompt_tokens)
        # NOTE: the larger of the two, not their product: with more workers than cores each step already waits
        # for a core, and the bandwidth it shares is the same; the product overstretched 3-worker layouts
        return max(1.0, k / cores, 1 + i * (k - 1))

    def end_step(self, w: SimWorker) -> None:
        self.computing -= 1
        out = w.end_step(self.now)
        self.gaps += out.gaps
        for r, n in out.chunk_pushes:
            if r.decode is not None and r.decode is not w and r.blocks:
                self.ship(r, n)
        for r in out.prompts_done:
            self.index.apply(w.worker_id, r.hashes, [])
            self.prompt_done(r, w)
        freed = bool(out.finished)
        for r in out.finished:
            w.release(r)
        self.start_step(w)
        if freed:
            self.retry_waiting()

    def prompt_done(self, r: SimRequest, w: SimWorker) -> None:
        """Its first token is out: it decodes where its KV is, after the last chunk's push lands."""
        if r.spec.output_len == 1:
            r.phase, r.finish_s = Phase.FINISHED, self.now
            if r.decode is not None and r.blocks:
                r.decode.release(r)
                self.retry_waiting()
            return
        r.phase = Phase.SENDING_KV
        if r.decode is w:
            self.kv_landed(r)
        elif not r.blocks:  # placed late: its decode blocks are reserved now
            if not self.reserve_late(r):
                self.held.append(r)
        else:
            self.at(self.links.get(self.link(r), self.now), lambda: self.kv_landed(r))

    def link(self, r: SimRequest) -> tuple[str, str]:
        assert r.prefill is not None and r.decode is not None
        return r.prefill.worker_id, r.decode.worker_id

    def ship(self, r: SimRequest, tokens: int) -> None:
        """Push `tokens` of the prompt's KV over its link, after what the link already carries."""
        key = self.link(r)
        self.links[key] = max(self.now, self.links.get(key, 0.0)) + self.profile.transfer.seconds(tokens)
        if r.phase is Phase.SENDING_KV and not r.kv_ready_s:  # (a late reservation's whole push)
            self.at(self.links[key], lambda: self.kv_landed(r))

    def kv_landed(self, r: SimRequest) -> None:
        if r.kv_ready_s is not None:
            return
        r.kv_ready_s = self.now
        assert r.decode is not None
        r.decode.add_decoding(r)
        self.start_step(r.decode)

    # -- the prediction -------------------------------------------------------------------------------

    def result(self) -> SimResult:
        router = self.profile.router.request_s
        out, tokens = [], 0
        last = max((r.finish_s for r in self.requests if r.finish_s is not None), default=self.now)
        for r in self.requests:
            arrival, first = r.spec.arrival_s, r.first_token_s
            ttft = None if first is None else first - arrival + router
            done = r.finish_s is not None
            mean_itl = ((r.finish_s - first) / (r.spec.output_len - 1)
                        if done and first is not None and r.spec.output_len > 1 else None)
            out.append(RequestResult(r.index, r.spec.kind, ttft, mean_itl,
                                     r.finish_s - arrival + router if r.finish_s is not None else None))
            tokens += r.spec.output_len if done else 0
        duration = max(1e-9, last - self.trace.requests[0].arrival_s)
        return SimResult(self.layout.label, self.trace.name, tuple(out), tuple(self.gaps), duration,
                         {w.worker_id: w.busy_s / duration for w in self.by_id.values()}, tokens / duration)


def simulate(profile: Profile, layout: Layout | str, trace: Trace, options: SimOptions = SimOptions()) -> SimResult:
    return Simulation(profile, Layout.parse(layout) if isinstance(layout, str) else layout, trace, options).run()
