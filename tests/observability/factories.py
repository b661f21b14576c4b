"""Small factories for driving `router.metrics.Metrics` the way the router and servicer do."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from protocol import PoolKind
from protocol.messages import EngineLoad, KVMoveResult, LoadReport, SpecCounts, WorkerInfo
from router.cost_model import CostModel
from router.metrics import Metrics
from router.placement import WorkerLoad
from router.registry import Worker
from router.router import RequestState, RouterEvent, Timing
from router.validation import ValidatedRequest

MODEL = "tiny"


def worker(worker_id: str, kind: PoolKind, node: str = "node-a", total: int = 100) -> Worker:
    info = WorkerInfo(worker_id, kind, node, "127.0.0.1", 16, total)
    return Worker(info, None, WorkerLoad(worker_id, node, kind, free_blocks=total, total_blocks=total))


def report(worker_id: str, running: int, waiting: int, free: int, total: int = 100,
           spec: SpecCounts | None = None, reserved: int = 0) -> LoadReport:
    return LoadReport(worker_id, EngineLoad(running, waiting, 0, free, total, 0, reserved, spec or SpecCounts()))


def request(rid: str, prompt: int = 32) -> ValidatedRequest:
    return ValidatedRequest(rid, list(range(prompt)), SamplingParams(max_tokens=64), ())


def state(rid: str, pool: str = "prefill", prefill: str = "prefill-0", decode: str = "decode-0",
          arrival: float = 1000.0, cached: int = 0) -> RequestState:
    st = RequestState(rid, request(rid), arrival=arrival, pool=pool, prefill_worker=prefill,
                      decode_worker=decode, num_cached_tokens=cached)
    st.timing = Timing(queue=0.01, prefill=0.02, kv_transfer=0.003, decode_admit=0.004)
    return st


def stream(m: Metrics, rid: str, tokens_per_event: list[int], outcome: str = "length", ttft: float = 0.05,
           gap: float = 0.01, prompt: int = 32, **state_kwargs) -> RequestState:
    """Send one request's events through the observer as the servicer does; return its state."""
    req, st = request(rid, prompt), state(rid, **state_kwargs)
    t = st.arrival + ttft
    for i, n in enumerate(tokens_per_event):
        m.on_event(req, st, RouterEvent(list(range(n)), None, first=i == 0, time=t))
        t += gap
    m.on_end(req, st, outcome, sum(tokens_per_event))
    return st


def drive_every_hook(m: Metrics) -> None:
    """One of everything: reports from both pools, transfers (one failed), streams ending each way."""
    p, d = worker("prefill-0", PoolKind.PREFILL), worker("decode-0", PoolKind.DECODE, node="node-b")
    m.on_report(p, report("prefill-0", 1, 2, 90))
    m.on_report(d, report("decode-0", 3, 0, 40, spec=SpecCounts(8, 5, 4, 9)))
    m.on_kv_transfer("prefill-0", "decode-0", 0.002, 4096, True)
    m.on_kv_transfer("prefill-0", "decode-0", 0.0, 0, False)
    for i, outcome in enumerate(("stop", "length", "cancelled", "error")):
        st = stream(m, f"r{i}", [1, 1, 1], outcome, cached=16)
    m.on_migration(st, "decode_lost", "recompute")
    m.on_migration_pause("kv", 0.1)
    m.on_kv_move("decode-0", "decode-1", KVMoveResult(True, 4096, 0.01))
    m.on_kv_move("decode-0", "decode-1", KVMoveResult(False, error="link broke"))
    m.on_pool_size("prefill", 1, 1)
    m.on_stalled_stream("http")
    m.on_quota_refused("acme", "tokens_per_minute")
    m.on_worker_lost(d)
    m.watch_cost(measured_cost())


def measured_cost() -> CostModel:
    """A cost model that has measured a prefill, a transfer and a decode step."""
    cost = CostModel(bytes_per_token=46_080)
    cost.observe_prefill("prefill-0", 512, 0.5)
    cost.observe_transfer("prefill-0", "decode-0", 4 << 20, 0.01)
    cost.observe_step("decode-0", 0.04)
    return cost
