"""The autoscaler's rules: traffic from the router's real counters, the forecast, cool-down, hysteresis,
bounds."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from planner.autoscaler import (
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REQUESTS,
    Autoscaler,
    Forecaster,
    RateWindow,
    ScalePolicy,
    Traffic,
    parse_counters,
    sizes_to_ask,
)
from router.metrics import Metrics


def test_traffic_comes_from_the_router_s_own_counters_summed_over_labels():
    registry = CollectorRegistry()
    requests = Counter(REQUESTS.removesuffix("_total"), "", ["finish_reason"], registry=registry)
    prompt = Counter(PROMPT_TOKENS.removesuffix("_total"), "", ["worker"], registry=registry)
    output = Counter(OUTPUT_TOKENS.removesuffix("_total"), "", ["worker"], registry=registry)
    before = parse_counters(generate_latest(registry).decode())
    requests.labels("stop").inc(6)
    requests.labels("length").inc(4)
    prompt.labels("p0").inc(600)
    prompt.labels("p1").inc(400)
    output.labels("d0").inc(500)
    traffic = Traffic.between(before, parse_counters(generate_latest(registry).decode()), 5.0)
    assert traffic == Traffic(rate=2.0, mean_prompt=100.0, mean_output=50.0)


def test_the_router_exports_the_counters_the_autoscaler_reads():
    metrics = Metrics("m", CollectorRegistry())
    metrics.requests.labels("m", "stop").inc()
    metrics.prompt_tokens.labels("m", "prefill", "p0").inc(3)
    metrics.generation_tokens.labels("m", "decode", "d0").inc(2)
    assert parse_counters(generate_latest(metrics.registry).decode()) == {REQUESTS: 1, PROMPT_TOKENS: 3, OUTPUT_TOKENS: 2}


def test_the_forecast_follows_a_rising_rate_ahead_of_its_level_and_never_goes_negative():
    f = Forecaster()
    assert f.observe(1.0) == 1.0
    rising = [f.observe(r) for r in (2.0, 3.0, 4.0)]
    assert rising[-1] > 3.5
    f = Forecaster()
    for r in (4.0, 2.0, 0.0, 0.0):
        last = f.observe(r)
    assert last >= 0.0


def _feed(window: RateWindow, per_interval: list[int], interval_s: float = 15.0) -> list[float]:
    """The window's rate after each interval that saw `per_interval[k]` requests."""
    total, rates = 0, []
    window.add(0.0, {REQUESTS: 0})
    for k, n in enumerate(per_interval, 1):
        total += n
        rates.append(window.add(k * interval_s, {REQUESTS: total}))
    return rates


def test_the_rate_at_low_traffic_is_read_over_enough_requests_and_a_step_still_shows_at_once():
    # a low phase of 0.1 req/s as Poisson arrivals deliver it in 15 s intervals: 0-3 a time
    low = [1, 0, 3, 1, 2, 2, 1, 3, 0, 2]
    raw = [n / 15 for n in low]
    windowed = _feed(RateWindow(), low)
    assert max(raw) - min(raw) == pytest.approx(0.2)
    # once the window has filled (the raw rates swing from 0 to 0.2): 0.10-0.14
    assert max(windowed[5:]) - min(windowed[5:]) < 0.05
    assert all(0.08 <= r <= 0.14 for r in windowed[5:]), windowed
    # a step to 2 req/s: 30 requests in the next interval are enough on their own
    assert _feed(RateWindow(), [*low, 30])[-1] == pytest.approx(2.0)
    # and the window reaches back no further than `max_intervals`, nor past its first scrape
    assert _feed(RateWindow(min_requests=100, max_intervals=3), [1, 1, 1, 1, 4])[-1] == pytest.approx(6 / 45)
    assert _feed(RateWindow(), [3])[-1] == pytest.approx(3 / 15)
    assert RateWindow().add(0.0, {REQUESTS: 5}) == 0.0
    # a fall reads high for a few intervals (it errs towards holding workers), then low
    falling = _feed(RateWindow(), [30, 30, 1, 2, 1, 2, 1, 2, 1, 2])
    assert falling[2] > 0.5 and falling[-1] == pytest.approx(8 / 75)
    # a router that restarted counts from 0 again: the window starts over, never a negative rate
    window = RateWindow()
    for t, n in ((0.0, 100), (15.0, 130), (30.0, 3), (45.0, 12)):
        rate = window.add(t, {REQUESTS: n})
        assert rate >= 0.0
    assert rate == pytest.approx(9 / 15)
    with pytest.raises(ValueError):
        RateWindow(min_requests=0)


def test_up_at_once_down_only_after_repeated_asks_and_never_inside_the_cool_down():
    scaler = Autoscaler(ScalePolicy(cooldown_s=60, down_after=2, max_pool_size=4))
    (up,) = scaler.decide(0, {"decode": 1}, {"decode": 9}, "rate 3/s")
    assert (up.current, up.target) == (1, 4)  # capped at max_pool_size
    assert scaler.decide(30, {"decode": 4}, {"decode": 1}, "rate 0.5/s") == []  # cooling down (1st ask)
    (down,) = scaler.decide(70, {"decode": 4}, {"decode": 1}, "rate 0.5/s")  # 2nd ask, cooled down
    assert (down.current, down.target) == (4, 1) and "drain" in down.reason
    assert scaler.decide(110, {"decode": 1}, {"decode": 3}, "rate 2/s") == []  # cooling down again


def test_one_dip_does_not_scale_down_but_a_second_in_a_row_does():
    scaler = Autoscaler(ScalePolicy(cooldown_s=0, down_after=2))
    assert scaler.decide(0, {"prefill": 3}, {"prefill": 2}, "dip") == []
    assert scaler.decide(10, {"prefill": 3}, {"prefill": 3}, "back") == []  # the dip is forgotten
    assert scaler.decide(20, {"prefill": 3}, {"prefill": 2}, "dip") == []
    assert [d.target for d in scaler.decide(30, {"prefill": 3}, {"prefill": 2}, "low")] == [2]


def test_no_pool_shrinks_while_no_layout_meets_the_slo_but_one_may_grow():
    current = {"prefill": 1, "decode": 2}
    closest = {"prefill": 1, "decode": 1}  # the fewest workers within a few points of the most attainment
    assert sizes_to_ask(closest, current, meets=False) == {"prefill": 1, "decode": 2}
    assert sizes_to_ask(closest, current, meets=True) == closest  # a plan that meets it may shrink a pool
    assert sizes_to_ask({"prefill": 2, "decode": 2}, current, meets=False) == {"prefill": 2, "decode": 2}


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError):
        ScalePolicy(min_pool_size=5, max_pool_size=2)


def test_the_watcher_sizes_on_a_trace_shaped_like_the_interval_and_reads_its_slo_file(tmp_path):
    from planner.watch import load_slo, synthetic_trace

    trace = synthetic_trace(Traffic(rate=2.0, mean_prompt=100.0, mean_output=40.0), rate=3.0)
    assert len(trace.requests) == 180 and abs(trace.rate - 3.0) < 0.6
    assert all(50 <= r.prompt_len <= 150 and 20 <= r.output_len <= 60 for r in trace.requests)
    path = tmp_path / "slo.json"
    path.write_text('{"ttft_s": 2, "itl_s": 0.1}')
    assert (load_slo(str(path)).ttft_s, load_slo(str(path)).target) == (2.0, 0.9)
    path.write_text('{"ttft_s": 2, "itl_s": 0.1, "margin": 0.25}')
    assert (load_slo(str(path)).ttft_s, load_slo(str(path)).itl_s) == pytest.approx((1.5, 0.075))
    path.write_text('{"ttft": 2}')
    with pytest.raises(ValueError, match="ttft_s"):
        load_slo(str(path))


@pytest.mark.parametrize("argv, words", [
    (["--autoscale", "slo.json"], "--autoscale needs --autoscale-profile"),
    (["--autoscale-profile", "p.json"], "--autoscale-profile goes with --autoscale"),
    (["--autoscale", "slo.json", "--autoscale-profile", "p.json", "--metrics-port", "off"], "--metrics-port"),
    (["--autoscale", "slo.json", "--autoscale-profile", "p.json", "--colocated-workers", "2", "--prefill-workers",
      "0", "--decode-workers", "0"], "colocated"),
    (["--autoscale", "slo.json", "--autoscale-profile", "p.json", "--autoscale-interval", "0"],
     "--autoscale-interval"),
    (["--autoscale", "slo.json", "--autoscale-profile", "p.json", "--autoscale-as-profiled"],
     "--max-pool-size must be at most 6, got 64"),
    (["--autoscale", "slo.json", "--autoscale-profile", "p.json", "--kv-cache-memory-bytes", "1000000"],
     "size the cache with --num-blocks, not --kv-cache-memory-bytes"),
])
def test_serve_s_autoscale_flags_are_checked_naming_the_flag(argv, words):
    from control.cli import build_parser, serve_config

    with pytest.raises(ValueError, match=re.escape(words)):
        serve_config(build_parser().parse_args(["serve", *argv]))


def test_serve_s_autoscale_flags_make_its_config():
    from control.cli import build_parser, serve_config

    config = serve_config(build_parser().parse_args(["serve", "--autoscale", "slo.json", "--autoscale-profile",
                                                      "p.json", "--autoscale-interval", "5", "--autoscale-advise"]))
    assert config.autoscale is not None and config.autoscale.interval_s == 5 and not config.autoscale.apply
    assert serve_config(build_parser().parse_args(["serve"])).autoscale is None


def test_the_serve_process_sizes_with_its_own_engine_settings(tmp_path):
    from control.autoscale import as_deployed
    from control.cli import build_parser, serve_config
    from tests.planner.test_simulator import profile

    args = ["serve", "--num-blocks", "96", "--block-size", "32", "--prefill-chunk-tokens", "128",
            "--autoscale", "slo.json", "--autoscale-profile", "p.json", "--autoscale-as-profiled",
            "--max-pool-size", "2"]
    config = serve_config(build_parser().parse_args(args))
    assert config.autoscale is not None and config.autoscale.as_profiled
    engine = as_deployed(profile(), config).engine
    assert (engine.num_blocks, engine.block_size, engine.prefill_chunk_tokens) == (96, 32, 128)
    # KV left to free memory: the profile's count stands
    assert as_deployed(profile(), serve_config(build_parser().parse_args(["serve"]))).engine.num_blocks == 4096
