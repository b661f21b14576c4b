"""Prometheus metrics of the router process: TTFT under the prefill pool, ITL under the decode pool.

`Metrics` is the process's one metrics owner (a `RequestObserver`): it keeps its own `CollectorRegistry`
(never prometheus_client's global one, so several servers can live in one test process) and
`router.metrics_export.MetricsEndpoint` serves it at `/metrics`. Labels are bounded: `model`, `pool`, `worker`, `node`, `stage`,
`finish_reason`, `src`/`dst` (worker ids); never a request id.

What is observed, and when (every hook runs on the router's event loop, so nothing here locks):
- TTFT, once per request, when its first token is handed to the client: event time - arrival, labelled
  with the pool that computed it (`prefill`, or `colocated`) and that pool's worker.
- ITL, per gap between consecutive tokens the client is sent, labelled with the decoding pool (`decode`,
  or `colocated`) and worker. A stream of k tokens gives k - 1 observations: an event carrying several
  tokens observes the gap since the previous event for its first token and 0 for the rest (they reached
  the client together). Events without tokens (a bare finish) observe nothing.
- TTFT stages, request totals, token counters, e2e latency and the prefix-cache hit ratio when the stream
  ends (`on_end`). Stages come from `RequestState.timing` for requests that got a first token:
  `queue`, `prefill`, `kv_transfer` on the disaggregated path (`decode_admit` too once a decode token
  reached the client); only `queue` on the colocated path, whose engine queues and prefills in one.
- Per-worker load gauges from every load report, and each decoding worker's draft, accepted and decode
  token counts (speculative decoding's acceptance rate and tokens per step); KV-transfer latency, bytes and failures per
  (prefill, decode) pair from the router's transfer notices.
- Migrations by cause and method, the pause each migrated stream showed, KV bytes moved between decode
  workers by drains, and each pool's live against target size.
- The router's cost model (`pdserve_cost_*`: prefill rates, link rates, decode step times), read from it
  at scrape time.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protocol import PoolKind
from protocol.messages import SpecCounts
from router.metrics_export import CostGauges
from router.observer import RequestObserver

if TYPE_CHECKING:
    from protocol.messages import KVMoveResult, LoadReport
    from router.cost_model import CostModel
    from router.registry import Worker
    from router.router import RequestState, RouterEvent
    from router.validation import ValidatedRequest

# NOTE: wide on purpose: a CPU deployment of a real model takes seconds to first token, a GPU one
# milliseconds, and a queue under overload minutes.
TTFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)
KV_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                       1.0, 2.5, 5.0, 10.0, 30.0)

STAGES = ("queue", "prefill", "kv_transfer", "decode_admit")
OUTCOMES = ("stop", "length", "cancelled", "error")  # what `on_end` is told; the finish_reason label
# router.lifecycle.Cause's values (kept as strings: the metrics need nothing else of the lifecycle)
MIGRATION_CAUSES = ("prefill_lost", "decode_lost", "kv_transfer", "reservation", "worker_error", "drain")
MIGRATION_METHODS = ("kv", "recompute")
PLACEMENT_PATHS = ("remote", "local")
# the largest token gap a migrated stream shows: a KV move's ~0.1 s up to a long prompt's recompute
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class _Stream:
    """What the metrics remember of one request between its events (dropped at `on_end`)."""

    last_token_at: float
    num_tokens: int
    # the ITL histogram child of the worker decoding it (NOTE: kept, not looked up by labels per token:
    # the lookup was a tenth of the router's per-token cost); a migration changes the worker
    itl: object = None
    itl_worker: str | None = None


class Metrics(RequestObserver):
    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.registry = registry or CollectorRegistry()
        self._cost_gauges: CostGauges | None = None
        r = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Arrival at the router to the first token sent to the "
            "client, by the pool and worker that prefilled it.", ["model", "pool", "worker"],
            buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Gap between consecutive tokens sent to the client, by the "
            "pool and worker that decoded them.", ["model", "pool", "worker"], buckets=ITL_BUCKETS, registry=r)
        self.ttft_stage = Histogram(
            "pdserve_ttft_stage_seconds", "Time to first token split into stages: queue, prefill, kv_transfer; "
            "decode_admit is first token out -> first decode token out.", ["model", "pool", "stage"],
            buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Arrival to the last token of requests that finished "
            "(stop or length).", ["model"], buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(
            "pdserve_requests_total", "Streams that ended, by how: stop, length, cancelled (by the client), "
            "error.", ["model", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens_total", "Prompt tokens of requests whose prefill finished, by prefill "
            "worker.", ["model", "pool", "worker"], registry=r)
        self.cached_prompt_tokens = Counter(
            "pdserve_cached_prompt_tokens_total", "Prompt tokens served from the prefill worker's prefix "
            "cache.", ["model", "pool", "worker"], registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens_total", "Tokens sent to clients, by the worker that decoded them.",
            ["model", "pool", "worker"], registry=r)
        self.prefix_hit_ratio = Gauge(
            "pdserve_prefix_cache_hit_ratio", "Cached prompt tokens / prompt tokens, cumulative per prefill "
            "worker.", ["model", "pool", "worker"], registry=r)
        load_labels = ["model", "pool", "worker", "node"]
        self.running = Gauge("pdserve_num_requests_running", "Sequences in the worker's running batch.",
                             load_labels, registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Sequences queued on the worker.",
                             load_labels, registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_ratio", "1 - free KV blocks / total KV blocks "
                              "(evictable prefix-cache blocks count as free).", load_labels, registry=r)
        self.kv_reserved = Gauge("pdserve_kv_reserved_ratio", "KV blocks a decode worker holds for prompts whose "
                                 "KV has not landed yet (reserved at placement, idle while the prompt queues "
                                 "and prefills elsewhere) / total KV blocks.", load_labels, registry=r)
        # speculative decoding, from each decode/colocated worker's cumulative counts (see `on_report`):
        # acceptance = rate(accepted) / rate(draft); tokens per step = rate(decode tokens) / rate(seq steps)
        self.spec_draft = Counter("pdserve_spec_draft_tokens", "Draft tokens verified.", load_labels, registry=r)
        self.spec_accepted = Counter("pdserve_spec_accepted_tokens", "Draft tokens the target model agreed "
                                     "with.", load_labels, registry=r)
        self.decode_steps = Counter("pdserve_decode_seq_steps", "(sequence, engine step) pairs that decoded, "
                                    "speculating or not.", load_labels, registry=r)
        self.decode_tokens = Counter("pdserve_decode_tokens", "Tokens those decode steps appended.",
                                     load_labels, registry=r)
        self._spec_seen: dict[str, SpecCounts] = {}  # worker id -> the counts its last report carried
        self.kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds", "A prompt's KV transfer, opened -> last layer acknowledged "
            "(overlaps the prefill compute).", ["model", "src", "dst"], buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes_total", "KV bytes sent from prefill to decode "
                                "workers.", ["model", "src", "dst"], registry=r)
        self.kv_failures = Counter("pdserve_kv_transfer_failures_total", "Prefills whose KV transfer (or "
                                   "the prefill itself) failed.", ["model", "src", "dst"], registry=r)

        self.migrations = Counter(
            "pdserve_request_migrations_total", "Requests moved to other workers mid-flight (or ended past "
            "--migration-limit), by cause (drain, or a failure: prefill_lost, decode_lost, kv_transfer, "
            "reservation, worker_error) and method (kv: the running sequence's KV moved; recompute: placed "
            "again with the tokens so far).", ["model", "cause", "method"], registry=r)
        self.migration_pause = Histogram(
            "pdserve_migration_pause_seconds", "The token gap a migrated stream shows: its last token before "
            "the migration to its first after.", ["model", "method"], buckets=PAUSE_BUCKETS, registry=r)
        self.kv_moved_bytes = Counter("pdserve_kv_moved_bytes_total", "KV bytes of running sequences moved "
                                      "between decode workers (drains).", ["model", "src", "dst"], registry=r)
        self.kv_move_failures = Counter("pdserve_kv_move_failures_total", "KV moves that failed (the "
                                        "sequence recomputed instead).", ["model", "src", "dst"], registry=r)
        self.placements = Counter(
            "pdserve_placement_total", "Disaggregated attempts by path: remote (prefill pool, KV shipped to the "
            "decode worker) or local (a short uncached prompt prefilled by its decode worker).",
            ["model", "path"], registry=r)
        self.index_resyncs = Counter(
            "pdserve_prefix_index_resyncs_total", "Times the router's prefix index fell behind a worker's "
            "cache-change log and was rebuilt from a full snapshot, per worker.", ["model", "worker"], registry=r)
        self.workers_lost = Counter(
            "pdserve_workers_lost_total", "Workers that died or were declared dead (stuck, unreachable), by "
            "pool.", ["model", "pool"], registry=r)
        self.pool_live = Gauge("pdserve_pool_live_workers", "Live workers per pool.", ["model", "pool"],
                               registry=r)
        self.pool_target = Gauge("pdserve_pool_target_workers", "Target size per pool.", ["model", "pool"],
                                 registry=r)
        self.pool_serving = Gauge("pdserve_pool_serving", "1 while the pool has at least one live worker.",
                                  ["model", "pool"], registry=r)
        self.pool_backoff = Gauge("pdserve_pool_replacement_backoff_seconds", "Seconds before the pool may start "
                                  "its next replacement worker: above 0 after failed starts or in a crash loop.",
                                  ["model", "pool"], registry=r)

        self.stalled = Counter("pdserve_stalled_streams_cancelled_total", "Streams whose client took no token for "
                               "--stalled-stream-timeout, cancelled (blocks freed).", ["model", "door"], registry=r)
        self.quota_refused = Counter("pdserve_quota_refused_total", "Requests refused at the door over a tenant's "
                                     "limit.", ["model", "tenant", "limit"], registry=r)
        for outcome in OUTCOMES:  # zero series exist from the start, so rate() and dashboards see them
            self.requests.labels(model, outcome)
        for door in ("grpc", "http"):
            self.stalled.labels(model, door)
        for cause in MIGRATION_CAUSES:
            for method in MIGRATION_METHODS:
                self.migrations.labels(model, cause, method)
        for method in MIGRATION_METHODS:
            self.migration_pause.labels(model, method)
        for path in PLACEMENT_PATHS:
            self.placements.labels(model, path)
        self._streams: dict[str, _Stream] = {}
        self._prompt: dict[str, tuple[int, int]] = {}  # prefill worker -> (prompt tokens, cached tokens)
        self._workers: dict[str, set[str]] = {PoolKind.PREFILL.value: set(), PoolKind.DECODE.value: set()}

    # -- RequestObserver --------------------------------------------------------------------------------

    def watch_cost(self, cost: CostModel) -> None:
        if self._cost_gauges is not None:  # (a router replaced in this process: read the new one's)
            self.registry.unregister(self._cost_gauges)
        self._cost_gauges = CostGauges(self.model, cost)
        self.registry.register(self._cost_gauges)

    def on_event(self, req: ValidatedRequest, state: RequestState, event: RouterEvent) -> None:
        n = len(event.token_ids)
        if n == 0:
            return
        stream = self._streams.get(state.id)
        if stream is None:  # the first event with tokens (`event.first` on every path the router has)
            self.ttft.labels(self.model, _pool_label(state.pool), state.prefill_worker).observe(event.time - state.arrival)
            self._streams[state.id] = _Stream(event.time, n)
            gaps = [0.0] * (n - 1)
        else:
            gaps = [event.time - stream.last_token_at] + [0.0] * (n - 1)
            stream.last_token_at = event.time
            stream.num_tokens += n
        if gaps:
            stream = self._streams[state.id]
            if stream.itl_worker != state.decode_worker:
                stream.itl = self.itl.labels(self.model, _decode_pool(state.pool), state.decode_worker)
                stream.itl_worker = state.decode_worker
            for gap in gaps:
                stream.itl.observe(max(gap, 0.0))

    def on_end(self, req: ValidatedRequest, state: RequestState | None, outcome: str,
               completion_tokens: int) -> None:
        """`state` may be None for a request that ended before the router yielded anything for it."""
        assert outcome in OUTCOMES, f"unknown outcome {outcome!r}"
        self.requests.labels(self.model, outcome).inc()
        stream = self._streams.pop(state.id, None) if state is not None else None
        if stream is None or state is None:  # ended before its first token: nothing reached the client
            return
        m, pool, prefill = self.model, _pool_label(state.pool), state.prefill_worker
        self.generation_tokens.labels(m, _decode_pool(pool), state.decode_worker).inc(stream.num_tokens)
        if outcome in ("stop", "length"):
            self.e2e.labels(m).observe(stream.last_token_at - state.arrival)

        t = state.timing
        stages = {"queue": t.queue}
        if pool == PoolKind.PREFILL.value:
            stages.update(prefill=t.prefill, kv_transfer=t.kv_transfer)
            if stream.num_tokens >= 2:  # a decode token reached the client: decode_admit was measured
                stages["decode_admit"] = t.decode_admit
        for stage, seconds in stages.items():
            self.ttft_stage.labels(m, pool, stage).observe(max(seconds, 0.0))

        self.prompt_tokens.labels(m, pool, prefill).inc(req.num_prompt_tokens)
        self.cached_prompt_tokens.labels(m, pool, prefill).inc(state.num_cached_tokens)
        prompt, cached = self._prompt.get(prefill, (0, 0))
        prompt, cached = prompt + req.num_prompt_tokens, cached + state.num_cached_tokens
        self._prompt[prefill] = (prompt, cached)
        self.prefix_hit_ratio.labels(m, pool, prefill).set(cached / prompt)

    def on_report(self, worker: Worker, report: LoadReport) -> None:
        load = report.load
        labels = (self.model, worker.kind.value, worker.worker_id, worker.info.node_id)
        self.running.labels(*labels).set(load.num_running)
        self.waiting.labels(*labels).set(load.num_waiting)
        self.kv_usage.labels(*labels).set(1.0 - load.free_blocks / load.total_blocks if load.total_blocks else 0.0)
        self.kv_reserved.labels(*labels).set(load.reserved_blocks / load.total_blocks if load.total_blocks else 0.0)
        self._on_spec_counts(labels, worker.worker_id, load.spec)
        known = self._workers.get(worker.kind.value)
        if known is not None and worker.worker_id not in known:
            known.add(worker.worker_id)
            self.index_resyncs.labels(self.model, worker.worker_id)  # a zero series from its first report
            # every (prefill, decode) pair gets its zero failure and byte counters as soon as both are known
            for src in self._workers[PoolKind.PREFILL.value]:
                for dst in self._workers[PoolKind.DECODE.value]:
                    self.kv_failures.labels(self.model, src, dst)
                    self.kv_bytes.labels(self.model, src, dst)
            # ... and every pair of decode workers its KV-move counters (a drain moves sequences between them)
            for src in self._workers[PoolKind.DECODE.value]:
                for dst in self._workers[PoolKind.DECODE.value] - {src}:
                    self.kv_moved_bytes.labels(self.model, src, dst)
                    self.kv_move_failures.labels(self.model, src, dst)

    def _on_spec_counts(self, labels: tuple[str, ...], worker_id: str, now: SpecCounts) -> None:
        # NOTE: the counts are cumulative in the worker, so a lost report costs nothing here; and a stale
        # one (a `report()` answer can land after a newer step's load) must not count backwards: each
        # counter takes only what exceeds the most it has seen
        seen = self._spec_seen.get(worker_id, SpecCounts())
        counters = (self.spec_draft, self.spec_accepted, self.decode_steps, self.decode_tokens)
        new, old = dataclasses.astuple(now), dataclasses.astuple(seen)
        if not any(new):
            return  # a prefill worker, or nothing decoded yet
        for counter, n, o in zip(counters, new, old):
            counter.labels(*labels).inc(max(0, n - o))
        self._spec_seen[worker_id] = SpecCounts(*map(max, new, old))

    def on_kv_transfer(self, src: str, dst: str, seconds: float, num_bytes: int, ok: bool) -> None:
        if not ok:
            self.kv_failures.labels(self.model, src, dst).inc()
            return
        self.kv_seconds.labels(self.model, src, dst).observe(seconds)
        self.kv_bytes.labels(self.model, src, dst).inc(num_bytes)

    def on_cache_resync(self, worker: Worker) -> None:
        self.index_resyncs.labels(self.model, worker.worker_id).inc()

    def on_worker_lost(self, worker: Worker) -> None:
        """Drop a lost worker's load gauges, so dashboards stop showing its last load as current.

        NOTE: counters and histograms keep its series: they are history, and rate() ends them by itself.
        """
        if not worker.draining:  # a drained worker was retired, not lost
            self.workers_lost.labels(self.model, worker.kind.value).inc()
        labels = (self.model, worker.kind.value, worker.worker_id, worker.info.node_id)
        self._spec_seen.pop(worker.worker_id, None)
        for gauge in (self.running, self.waiting, self.kv_usage, self.kv_reserved):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        self._workers.get(worker.kind.value, set()).discard(worker.worker_id)

    def on_stalled_stream(self, door: str) -> None:
        self.stalled.labels(self.model, door).inc()

    def on_quota_refused(self, tenant: str, limit: str) -> None:
        self.quota_refused.labels(self.model, tenant, limit).inc()

    def on_migration(self, state: RequestState, cause: str, method: str) -> None:
        self.migrations.labels(self.model, cause, method).inc()

    def on_placement(self, path: str) -> None:
        self.placements.labels(self.model, path).inc()

    def on_migration_pause(self, method: str, seconds: float) -> None:
        self.migration_pause.labels(self.model, method).observe(max(seconds, 0.0))

    def on_kv_move(self, src: str, dst: str, result: KVMoveResult) -> None:
        if result.ok:
            self.kv_moved_bytes.labels(self.model, src, dst).inc(result.num_bytes)
        else:
            self.kv_move_failures.labels(self.model, src, dst).inc()

    def on_pool_size(self, pool: str, live: int, target: int, backoff_s: float = 0.0) -> None:
        self.workers_lost.labels(self.model, pool)  # a zero series per pool from the start
        self.pool_live.labels(self.model, pool).set(live)
        self.pool_target.labels(self.model, pool).set(target)
        self.pool_serving.labels(self.model, pool).set(1 if live else 0)
        self.pool_backoff.labels(self.model, pool).set(backoff_s)


def _pool_label(pool: PoolKind | str) -> str:
    """A pool as a label value (`RequestState.pool` holds the enum)."""
    return PoolKind(pool).value


def _decode_pool(ttft_pool: PoolKind | str) -> str:
    """The pool that decodes a request whose first token came from `ttft_pool`."""
    return PoolKind.DECODE.value if ttft_pool == PoolKind.PREFILL else _pool_label(ttft_pool)
