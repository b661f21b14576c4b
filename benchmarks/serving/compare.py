"""Side by side: the same requests offered to every server, in alternating rounds.

NOTE: why rounds and not one layout after the other. On a shared machine the neighbours' load changes
from minute to minute (another user's test run takes a whole core for a while, then leaves); run A, then
B, and the comparison measures the neighbours as much as the layouts. So every server stays up for the
whole bench and each workload's requests are split into `rounds` consecutive slices, offered to the
servers in ABBA order (A B, then B A, ...): each layout gets the same requests and, on average, the same
machine. An idle server is not free on 2 cores: 3 idle workers slowed a measured 1c's decode steps by 7%
(2026-12-05, docs/planner.md), the same for every layout in one bench, but a run compared with a simulation
of that layout alone should launch it alone. The goodput searches
alternate the same way, one probe per server at a time. Each round's CPU use (ours and everyone else's)
is measured and reported, so what noise remains is visible.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.serving.client import RunResult, StopRule, run_load
from benchmarks.serving.cpu import CpuMeter, CpuShare
from benchmarks.serving.goodput import GoodputSearch, Probe
from benchmarks.serving.load import Load
from benchmarks.serving.report import LayoutRun
from benchmarks.serving.stats import SLO, Summary, itls, summarize, ttfts
from benchmarks.serving.workloads import RequestSpec, Vocab, Workload

WARMUP_SEED_OFFSET = 10_000  # warmup prompts never repeat a measured prompt (no prefix-cache head start)


@dataclass(frozen=True)
class Plan:
    """What to run on every server: the CLI's choices."""

    workloads: tuple[Workload, ...]
    load: Load
    slo: SLO
    search: GoodputSearch | None = None  # starts at load.rate
    rounds: int = 2  # slices of each run, offered in ABBA order
    warmup: int = 2  # unmeasured requests per server and workload, one at a time
    seed: int = 0
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 300.0
    progress: bool = True
    memory_probe: bool = False  # `benchmarks.serving.cpu.machine_speed` before and after each run

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.rounds > self.load.num_requests:
            raise ValueError(f"rounds ({self.rounds}) must be at most num_requests ({self.load.num_requests})")
        if self.search is not None and not self.load.open_loop:
            raise ValueError("--goodput searches open-loop rates: give the starting --rate")


@dataclass
class Target:
    """One server under test."""

    label: str
    description: str
    stub: object  # pdserve.v1 GenerationStub (grpc.aio)
    vocab: Vocab


async def compare(targets: Sequence[Target], plan: Plan) -> list[LayoutRun]:
    """Every workload on every target; one `LayoutRun` per (workload, target), workload-major."""
    runs: list[LayoutRun] = []
    for workload in plan.workloads:
        runs += await _compare_workload(targets, workload, plan)
    return runs


async def _run(target: Target, workload: Workload, specs: Sequence[RequestSpec], load: Load, plan: Plan, *,
               first_index: int = 0, what: str, stop_when: StopRule | None = None) -> RunResult:
    return await run_load(target.stub, specs, load, id_prefix=f"{workload.name}-{load.seed}",
                          first_index=first_index, request_timeout_s=plan.request_timeout_s,
                          drain_timeout_s=plan.drain_timeout_s, stop_when=stop_when, progress=plan.progress,
                          desc=f"{target.label} {workload.name} {what}")


def _abba(targets: Sequence[Target], k: int) -> Sequence[Target]:
    return targets if k % 2 == 0 else list(reversed(targets))


async def _compare_workload(targets: Sequence[Target], workload: Workload, plan: Plan) -> list[LayoutRun]:
    load = plan.load
    if plan.warmup:
        for t in targets:
            specs = workload.requests(plan.warmup, plan.seed + WARMUP_SEED_OFFSET, t.vocab)
            await _run(t, workload, specs, Load(concurrency=1, num_requests=plan.warmup), plan, what="warmup")

    parts: dict[str, list[RunResult]] = defaultdict(list)
    cpu: dict[str, CpuShare | None] = {}
    n = load.num_requests
    for k in range(plan.rounds):
        lo, hi = k * n // plan.rounds, (k + 1) * n // plan.rounds
        round_load = dataclasses.replace(
            load, num_requests=hi - lo, seed=load.seed + k,
            duration_s=None if load.duration_s is None else load.duration_s / plan.rounds)
        for t in _abba(targets, k):
            specs = workload.requests(n, plan.seed, t.vocab)[lo:hi]
            meter = CpuMeter(probe=plan.memory_probe)
            parts[t.label].append(await _run(t, workload, specs, round_load, plan, first_index=lo,
                                             what=f"{load.label} round {k + 1}/{plan.rounds}"))
            share = meter.stop()
            cpu[t.label] = share if k == 0 else (None if share is None or cpu[t.label] is None
                                                  else cpu[t.label] + share)

    runs = []
    for t in targets:
        run = layout_run(t.label, t.description, workload.name, RunResult.merge(load, parts[t.label]), plan.slo)
        run.cpu = cpu[t.label]
        s = run.summary
        _log(f"{t.label} {workload.name} {load.label}: {s.num_completed}/{s.num_sent} ok, "
             f"SLO met {s.slo_attainment:.0%}")
        runs.append(run)
    if plan.search is not None:
        await _search_goodput(targets, workload, plan, runs)
    return runs


async def _search_goodput(targets: Sequence[Target], workload: Workload, plan: Plan,
                          runs: list[LayoutRun]) -> None:
    """Each target's goodput search, one probe per target at a time, alternating; the run at `--rate`
    is every search's first probe."""
    search, slo = plan.search, plan.slo
    by_label = {r.layout: r for r in runs}
    probes: dict[str, list[Probe]] = {}
    for t in targets:
        r = by_label[t.label]
        probes[t.label] = [Probe(plan.load.rate, r.summary.slo_attainment)]
        r.probes.append(probe_dict(search, plan.load.rate, r.summary, cpu=r.cpu))
    k = 1
    while True:
        progressed = False
        for t in _abba(targets, k):
            rate = search.next_rate(probes[t.label])
            if rate is None:
                continue
            progressed = True
            seed = plan.seed + len(probes[t.label])  # fresh prompts and arrivals for every probe
            load = Load(rate=rate, num_requests=plan.load.num_requests, duration_s=plan.load.duration_s, seed=seed)
            specs = workload.requests(load.num_requests, seed, t.vocab)
            # NOTE: later probes stop as soon as they have certainly failed; the first (the table's row,
            # the run at --rate) always runs to the end.
            meter = CpuMeter(probe=plan.memory_probe)
            result = await _run(t, workload, specs, load, plan, what=f"probe {rate:.2f} req/s",
                                stop_when=search.hopeless(slo))
            summary = summarize(result, slo)
            probes[t.label].append(Probe(rate, summary.slo_attainment))
            by_label[t.label].probes.append(probe_dict(search, rate, summary, result.stopped_early, meter.stop()))
            _log(f"{t.label} {workload.name} goodput probe {rate:.3g} req/s: SLO met {summary.slo_attainment:.0%}"
                 + (" (stopped early: failed)" if result.stopped_early else ""))
        if not progressed:
            break
        k += 1
    for t in targets:
        by_label[t.label].goodput = search.result(probes[t.label])


def layout_run(label: str, description: str, workload: str, result: RunResult, slo: SLO) -> LayoutRun:
    by_kind = defaultdict(list)
    for r in result.records:
        by_kind[r.kind].append(r)
    kinds = {}
    if len(by_kind) > 1:
        kinds = {k: summarize(dataclasses.replace(result, records=recs), slo) for k, recs in sorted(by_kind.items())}
    return LayoutRun(label, description, workload, result.load.label, summarize(result, slo),
                     ttfts(result.records), itls(result.records), kinds)


def probe_dict(search: GoodputSearch, rate: float, summary: Summary, stopped_early: bool = False,
               cpu: CpuShare | None = None) -> dict:
    return {"rate": rate, "slo_attainment": summary.slo_attainment,
            "passed": search.passed(Probe(rate, summary.slo_attainment)), "stopped_early": stopped_early,
            "others_cores": None if cpu is None else round(cpu.others_cores, 2), "summary": summary.to_dict()}


def _log(msg: str) -> None:
    print(f"pdserve bench: {msg}", file=sys.stderr, flush=True)
