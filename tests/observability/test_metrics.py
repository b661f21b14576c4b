"""`router.metrics.Metrics` driven with synthetic requests: what is observed, under which labels, how often."""

from __future__ import annotations

import argparse
import math
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control.cli import _add_serve
from control.config import ServeConfig
from control.server import Server
from protocol import PoolKind
from router.cost_model import CostModel
from router.metrics import ITL_BUCKETS, TTFT_BUCKETS, Metrics
from router.metrics_export import MetricsEndpoint
from tests.observability.factories import (
    MODEL,
    drive_every_hook,
    measured_cost,
    report,
    request,
    state,
    stream,
    worker,
)

# The issue's list: family name (as prometheus_client names it) -> (type, labels)
EXPECTED = {
    "pdserve_time_to_first_token_seconds": ("histogram", {"model", "pool", "worker"}),
    "pdserve_inter_token_latency_seconds": ("histogram", {"model", "pool", "worker"}),
    "pdserve_ttft_stage_seconds": ("histogram", {"model", "pool", "stage"}),
    "pdserve_e2e_request_latency_seconds": ("histogram", {"model"}),
    "pdserve_requests": ("counter", {"model", "finish_reason"}),
    "pdserve_prompt_tokens": ("counter", {"model", "pool", "worker"}),
    "pdserve_cached_prompt_tokens": ("counter", {"model", "pool", "worker"}),
    "pdserve_generation_tokens": ("counter", {"model", "pool", "worker"}),
    "pdserve_prefix_cache_hit_ratio": ("gauge", {"model", "pool", "worker"}),
    "pdserve_num_requests_running": ("gauge", {"model", "pool", "worker", "node"}),
    "pdserve_num_requests_waiting": ("gauge", {"model", "pool", "worker", "node"}),
    "pdserve_kv_cache_usage_ratio": ("gauge", {"model", "pool", "worker", "node"}),
    "pdserve_kv_reserved_ratio": ("gauge", {"model", "pool", "worker", "node"}),
    "pdserve_spec_draft_tokens": ("counter", {"model", "pool", "worker", "node"}),
    "pdserve_spec_accepted_tokens": ("counter", {"model", "pool", "worker", "node"}),
    "pdserve_decode_seq_steps": ("counter", {"model", "pool", "worker", "node"}),
    "pdserve_decode_tokens": ("counter", {"model", "pool", "worker", "node"}),
    "pdserve_kv_transfer_seconds": ("histogram", {"model", "src", "dst"}),
    "pdserve_kv_transfer_bytes": ("counter", {"model", "src", "dst"}),
    "pdserve_kv_transfer_failures": ("counter", {"model", "src", "dst"}),
    "pdserve_request_migrations": ("counter", {"model", "cause", "method"}),
    "pdserve_migration_pause_seconds": ("histogram", {"model", "method"}),
    "pdserve_kv_moved_bytes": ("counter", {"model", "src", "dst"}),
    "pdserve_kv_move_failures": ("counter", {"model", "src", "dst"}),
    "pdserve_placement": ("counter", {"model", "path"}),
    "pdserve_workers_lost": ("counter", {"model", "pool"}),
    "pdserve_prefix_index_resyncs": ("counter", {"model", "worker"}),
    "pdserve_pool_live_workers": ("gauge", {"model", "pool"}),
    "pdserve_pool_target_workers": ("gauge", {"model", "pool"}),
    "pdserve_pool_serving": ("gauge", {"model", "pool"}),
    "pdserve_pool_replacement_backoff_seconds": ("gauge", {"model", "pool"}),
    "pdserve_cost_prefill_tokens_per_second": ("gauge", {"model", "worker"}),
    "pdserve_cost_link_bytes_per_second": ("gauge", {"model", "src", "dst"}),
    "pdserve_cost_decode_step_seconds": ("gauge", {"model", "worker"}),
    "pdserve_cost_decode_step_per_sequence_seconds": ("gauge", {"model", "worker"}),
    # issue 30: the front door
    "pdserve_stalled_streams_cancelled": ("counter", {"model", "door"}),
    "pdserve_quota_refused": ("counter", {"model", "tenant", "limit"}),
}


def value(m: Metrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, {"model": MODEL, **labels})
    return 0.0 if v is None else v


def total(m: Metrics, name: str) -> float:
    """A sample summed over every label set (e.g. a histogram's `_count` over all workers)."""
    return sum(s.value for fam in m.registry.collect() for s in fam.samples if s.name == name)


# -- counts agree with the streams ----------------------------------------------------------------------

def test_ttft_once_per_request_and_itl_once_per_token_gap():
    m = Metrics(MODEL)
    streams = [[1], [1, 1], [1, 1, 1, 1, 1], [1, 3, 1], [1, 1, 0], [1] + [1] * 20, [1, 2]]
    for i, events in enumerate(streams):
        stream(m, f"req-{i}", events, ttft=0.1 * (i + 1), gap=0.01)

    ttft = dict(pool="prefill", worker="prefill-0")
    itl = dict(pool="decode", worker="decode-0")
    assert value(m, "pdserve_time_to_first_token_seconds_count", **ttft) == len(streams)
    assert value(m, "pdserve_time_to_first_token_seconds_sum", **ttft) == pytest.approx(
        sum(0.1 * (i + 1) for i in range(len(streams))))
    assert value(m, "pdserve_inter_token_latency_seconds_count", **itl) == sum(sum(s) - 1 for s in streams)
    # a gap per later event with tokens; the extra tokens of a multi-token event arrived with it (gap 0)
    gaps = sum(1 for s in streams for n in s[1:] if n)
    assert value(m, "pdserve_inter_token_latency_seconds_sum", **itl) == pytest.approx(0.01 * gaps)
    # nothing else carries those observations
    assert total(m, "pdserve_time_to_first_token_seconds_count") == len(streams)
    assert total(m, "pdserve_inter_token_latency_seconds_count") == sum(sum(s) - 1 for s in streams)
    assert value(m, "pdserve_generation_tokens_total", **itl) == sum(sum(s) for s in streams)


def test_a_stream_that_ends_before_its_first_token_counts_only_as_a_request():
    m = Metrics(MODEL)
    stream(m, "gone", [], "cancelled")
    stream(m, "failed", [], "error")
    assert value(m, "pdserve_requests_total", finish_reason="cancelled") == 1
    assert value(m, "pdserve_requests_total", finish_reason="error") == 1
    assert total(m, "pdserve_time_to_first_token_seconds_count") == 0
    assert total(m, "pdserve_ttft_stage_seconds_count") == 0
    assert total(m, "pdserve_prompt_tokens_total") == 0
    m.on_end(request("rejected"), None, "error", 0)  # failed before the router yielded any state
    assert value(m, "pdserve_requests_total", finish_reason="error") == 2
    assert m._streams == {}  # nothing remembered for ended requests


def test_requests_by_finish_reason_start_at_zero_and_count_each_end():
    m = Metrics(MODEL)
    for reason in ("stop", "length", "cancelled", "error"):
        assert m.registry.get_sample_value("pdserve_requests_total",
                                           {"model": MODEL, "finish_reason": reason}) == 0.0
    for i, outcome in enumerate(["stop", "stop", "length", "cancelled", "error", "stop"]):
        stream(m, f"r{i}", [1, 1], outcome)
    assert value(m, "pdserve_requests_total", finish_reason="stop") == 3
    assert value(m, "pdserve_requests_total", finish_reason="length") == 1
    assert value(m, "pdserve_e2e_request_latency_seconds_count") == 4  # finished ones only


def test_ttft_stages_come_from_the_timing_and_decode_admit_only_when_measured():
    m = Metrics(MODEL)
    stream(m, "one-token", [1])
    stream(m, "two-tokens", [1, 1])
    stage = lambda s: value(m, "pdserve_ttft_stage_seconds_count", pool="prefill", stage=s)
    assert [stage(s) for s in ("queue", "prefill", "kv_transfer", "decode_admit")] == [2, 2, 2, 1]
    assert value(m, "pdserve_ttft_stage_seconds_sum", pool="prefill", stage="kv_transfer") == pytest.approx(0.006)
    assert value(m, "pdserve_ttft_stage_seconds_sum", pool="prefill", stage="decode_admit") == pytest.approx(0.004)


def test_colocated_requests_are_labelled_with_the_colocated_pool_and_worker():
    m = Metrics(MODEL)
    stream(m, "c", [1, 1, 1], pool="colocated", prefill="colocated-1", decode="colocated-1")
    labels = dict(pool="colocated", worker="colocated-1")
    assert value(m, "pdserve_time_to_first_token_seconds_count", **labels) == 1
    assert value(m, "pdserve_inter_token_latency_seconds_count", **labels) == 2
    # the colocated engine queues and prefills in one: only the queue stage exists
    assert value(m, "pdserve_ttft_stage_seconds_count", pool="colocated", stage="queue") == 1
    assert total(m, "pdserve_ttft_stage_seconds_count") == 1


def test_prefix_cache_hit_ratio_is_cumulative_per_prefill_worker():
    m = Metrics(MODEL)
    stream(m, "a", [1], prompt=32, cached=16)
    stream(m, "b", [1], prompt=32, cached=32)
    stream(m, "c", [1], prompt=10, cached=0, prefill="prefill-1")
    assert value(m, "pdserve_prefix_cache_hit_ratio", pool="prefill", worker="prefill-0") == 0.75
    assert value(m, "pdserve_prefix_cache_hit_ratio", pool="prefill", worker="prefill-1") == 0.0
    assert value(m, "pdserve_prompt_tokens_total", pool="prefill", worker="prefill-0") == 64
    assert value(m, "pdserve_cached_prompt_tokens_total", pool="prefill", worker="prefill-0") == 48


def test_load_reports_set_per_worker_gauges_and_zero_failure_counters_per_pair():
    m = Metrics(MODEL)
    p, d = worker("prefill-0", PoolKind.PREFILL), worker("decode-0", PoolKind.DECODE, node="node-b")
    m.on_report(p, report("prefill-0", 1, 4, 100))
    m.on_report(d, report("decode-0", 7, 0, 25, reserved=30))
    labels = dict(pool="decode", worker="decode-0", node="node-b")
    assert value(m, "pdserve_num_requests_running", **labels) == 7
    assert value(m, "pdserve_num_requests_waiting", pool="prefill", worker="prefill-0", node="node-a") == 4
    assert value(m, "pdserve_kv_cache_usage_ratio", **labels) == 0.75
    assert value(m, "pdserve_kv_reserved_ratio", **labels) == 0.30  # 30 of the 75 used wait for their KV
    pair = {"model": MODEL, "src": "prefill-0", "dst": "decode-0"}
    assert m.registry.get_sample_value("pdserve_kv_transfer_failures_total", pair) == 0.0

    m.on_worker_lost(d)
    assert m.registry.get_sample_value("pdserve_num_requests_running", {"model": MODEL, **labels}) is None
    assert value(m, "pdserve_workers_lost_total", pool="decode") == 1


def test_migrations_by_cause_and_pool_sizes():
    m = Metrics(MODEL)
    st = state("r1")
    m.on_migration(st, "decode_lost", "recompute")
    m.on_migration(st, "decode_lost", "recompute")
    m.on_migration(st, "prefill_lost", "recompute")
    m.on_migration(st, "drain", "kv")
    assert value(m, "pdserve_request_migrations_total", cause="decode_lost", method="recompute") == 2
    assert value(m, "pdserve_request_migrations_total", cause="prefill_lost", method="recompute") == 1
    assert value(m, "pdserve_request_migrations_total", cause="drain", method="kv") == 1
    assert value(m, "pdserve_request_migrations_total", cause="drain", method="recompute") == 0
    m.on_pool_size("prefill", 0, 2)
    assert value(m, "pdserve_pool_serving", pool="prefill") == 0
    assert value(m, "pdserve_pool_target_workers", pool="prefill") == 2
    m.on_pool_size("prefill", 1, 2, backoff_s=4.0)
    assert value(m, "pdserve_pool_serving", pool="prefill") == 1
    assert value(m, "pdserve_pool_live_workers", pool="prefill") == 1
    assert value(m, "pdserve_pool_replacement_backoff_seconds", pool="prefill") == 4.0


def test_kv_transfers_observe_latency_and_bytes_and_count_failures():
    m = Metrics(MODEL)
    m.on_kv_transfer("prefill-0", "decode-0", 0.004, 1 << 20, True)
    m.on_kv_transfer("prefill-0", "decode-0", 0.002, 1 << 20, True)
    m.on_kv_transfer("prefill-0", "decode-0", 0.1, 0, False)
    pair = dict(src="prefill-0", dst="decode-0")
    assert value(m, "pdserve_kv_transfer_seconds_count", **pair) == 2
    assert value(m, "pdserve_kv_transfer_bytes_total", **pair) == 2 << 20
    assert value(m, "pdserve_kv_transfer_failures_total", **pair) == 1


def test_the_cost_model_is_exported_as_measured_and_forgets_a_worker_that_left():
    m = Metrics(MODEL)
    cost = measured_cost()
    m.watch_cost(cost)
    assert value(m, "pdserve_cost_prefill_tokens_per_second", worker="prefill-0") == 1024
    assert value(m, "pdserve_cost_link_bytes_per_second", src="prefill-0", dst="decode-0") == 400 << 20
    assert value(m, "pdserve_cost_decode_step_seconds", worker="decode-0") == 0.04
    cost.observe_step("decode-0", 0.09)  # read at scrape time: the mean moves (the older step weighs 0.95)
    assert value(m, "pdserve_cost_decode_step_seconds", worker="decode-0") == pytest.approx((0.95 * 0.04 + 0.09) / 1.95)
    assert value(m, "pdserve_cost_decode_step_per_sequence_seconds", worker="decode-0") == 0.0  # one batch size
    cost.forget("decode-0")
    assert m.registry.get_sample_value("pdserve_cost_decode_step_seconds", {"model": MODEL, "worker": "decode-0"}) is None
    assert m.registry.get_sample_value("pdserve_cost_link_bytes_per_second",
                                       {"model": MODEL, "src": "prefill-0", "dst": "decode-0"}) is None
    m.watch_cost(CostModel(bytes_per_token=1))  # a new router in this process: its model replaces the old
    assert m.registry.get_sample_value("pdserve_cost_prefill_tokens_per_second",
                                       {"model": MODEL, "worker": "prefill-0"}) is None


# -- names, labels, buckets -----------------------------------------------------------------------------

def test_metric_names_types_and_labels_are_the_issues_list():
    m = Metrics(MODEL)
    drive_every_hook(m)
    text = generate_latest(m.registry).decode()
    # the text format shows prometheus_client's `<name>_created` timestamps as families of their own
    families = {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    assert set(families) == set(EXPECTED)
    for name, (kind, labels) in EXPECTED.items():
        fam = families[name]
        assert fam.type == kind, name
        assert fam.samples, f"{name} has no series after every hook ran"
        for s in fam.samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            assert not any(v.startswith("r") and v[1:].isdigit() for v in s.labels.values()), \
                f"{name}: a request id leaked into a label: {s.labels}"


def test_buckets_resolve_cpu_and_gpu_scales():
    assert TTFT_BUCKETS[0] <= 0.001 and TTFT_BUCKETS[-1] >= 300  # sub-millisecond to minutes
    assert ITL_BUCKETS[0] <= 0.001 and ITL_BUCKETS[-1] >= 10
    assert list(TTFT_BUCKETS) == sorted(set(TTFT_BUCKETS)) and list(ITL_BUCKETS) == sorted(set(ITL_BUCKETS))


def test_each_metrics_owns_its_registry():
    a, b = Metrics(MODEL), Metrics(MODEL)  # the global registry would raise on the second
    stream(a, "x", [1, 1])
    assert total(a, "pdserve_time_to_first_token_seconds_count") == 1
    assert total(b, "pdserve_time_to_first_token_seconds_count") == 0


# -- the endpoint and its configuration ----------------------------------------------------------------

def test_endpoint_serves_the_registry_on_any_free_port():
    m = Metrics(MODEL)
    stream(m, "x", [1, 1, 1])
    endpoint = MetricsEndpoint(m.registry, "127.0.0.1", 0)
    try:
        assert endpoint.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10) as res:
            text = res.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        count = [s for s in fams["pdserve_inter_token_latency_seconds"].samples if s.name.endswith("_count")]
        assert [s.value for s in count] == [2.0]
    finally:
        endpoint.close()
    with pytest.raises(OSError):  # closed: the port is free again, nobody answers
        urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=2)


def test_metrics_port_is_validated_and_parsed():
    with pytest.raises(ValueError, match="--metrics-port"):
        ServeConfig(metrics_port=70000)
    with pytest.raises(ValueError, match="--metrics-port"):
        ServeConfig(port=9400, metrics_port=9400)
    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers())
    assert parser.parse_args(["serve"]).metrics_port == 9400
    assert parser.parse_args(["serve", "--metrics-port", "0"]).metrics_port == 0
    assert parser.parse_args(["serve", "--metrics-port", "off"]).metrics_port is None


def test_server_owns_one_metrics_unless_disabled():
    assert isinstance(Server(ServeConfig(metrics_port=0)).metrics, Metrics)
    assert Server(ServeConfig(metrics_port=None)).metrics is None
    mine = Metrics("mine")
    assert Server(ServeConfig(metrics_port=0), mine).metrics is mine


def test_gauges_are_finite_for_a_worker_without_blocks():
    m = Metrics(MODEL)
    m.on_report(worker("decode-0", PoolKind.DECODE, total=0), report("decode-0", 0, 0, 0, total=0))
    assert math.isfinite(value(m, "pdserve_kv_cache_usage_ratio", pool="decode", worker="decode-0", node="node-a"))


def test_migration_cause_labels_are_the_lifecycles_causes():
    from router.lifecycle import Cause, Method
    from router.metrics import MIGRATION_CAUSES, MIGRATION_METHODS

    assert tuple(c.value for c in Cause) == MIGRATION_CAUSES
    assert tuple(m.value for m in Method) == MIGRATION_METHODS
    m = Metrics(MODEL)
    for cause in MIGRATION_CAUSES:  # every series exists at zero from the start, for rate() and dashboards
        for method in MIGRATION_METHODS:
            assert m.registry.get_sample_value("pdserve_request_migrations_total",
                                               {"model": MODEL, "cause": cause, "method": method}) == 0.0


def test_speculation_counters_follow_cumulative_reports_and_ignore_stale_ones():
    from protocol.messages import SpecCounts

    m = Metrics(MODEL)
    d = worker("decode-0", PoolKind.DECODE)
    labels = dict(pool="decode", worker="decode-0", node="node-a")
    m.on_report(d, report("decode-0", 1, 0, 50, spec=SpecCounts(8, 5, 4, 9)))
    m.on_report(d, report("decode-0", 1, 0, 50, spec=SpecCounts(6, 4, 3, 7)))  # an older snapshot, late
    m.on_report(d, report("decode-0", 1, 0, 50, spec=SpecCounts(12, 6, 6, 13)))
    assert value(m, "pdserve_spec_draft_tokens_total", **labels) == 12
    assert value(m, "pdserve_spec_accepted_tokens_total", **labels) == 6
    assert value(m, "pdserve_decode_seq_steps_total", **labels) == 6
    assert value(m, "pdserve_decode_tokens_total", **labels) == 13
