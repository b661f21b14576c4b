"""`pdserve plan`: profile a deployment, simulate a layout on a trace, size the pools for an SLO.

    pdserve plan profile --launch --out profile.json
    pdserve plan simulate --profile profile.json --layout 2p1d --workload chat --rate 1 --num-requests 60
    pdserve plan size --profile profile.json --workload rag --rate 4 --ttft-slo 2 --itl-slo 0.1
    pdserve plan watch --profile profile.json --slo-file slo.json [--apply]

`control.cli` hands every `pdserve plan ...` command line to `main` here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from planner.profile import EngineSettings, Profile
from planner.results import SLO


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a profile file (pdserve plan profile)")
    p.add_argument("--device", default=None,
                   help="the profile's constants for a device from published figures: h100 (planner/devices.py)")
    p.add_argument("--target-model", default=None,
                   help="with --device: the model to size for (smollm2-135m, llama3-8b; default the profiled one)")
    p.add_argument("--workload", default="chat",
                   help="chat, rag, agent, burst (pdserve bench's), or a .jsonl trace of {arrival_s, prompt_len, "
                        "output_len[, prefix_id, prefix_len]} lines")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (Poisson; a .jsonl trace is rescaled to it when given)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="as pdserve bench's --seed")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds, on each request's mean gap (default 0.1)")
    p.add_argument("--slo-target", type=float, default=0.9, help="share of requests meeting both (default 0.9)")
    p.add_argument("--slo-margin", type=float, default=0.0,
                   help="size against both bounds less this share (0.15: 15%% tighter), headroom for a machine "
                        "whose speed drifts between runs (default 0)")
    p.add_argument("--no-late-reservation", action="store_true", help="as pdserve serve's flag")
    p.add_argument("--json", default=None, help="also write the result as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure a 1p1d deployment into a profile file")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--launch", action="store_true", help="start a 1p1d deployment here, as pdserve bench")
    target.add_argument("--server", metavar="HOST:PORT", help="a running 1-prefill + 1-decode deployment")
    target.add_argument("--refit", metavar="PROFILE",
                        help="fit an earlier profile's stored samples again with this version's fitting (its "
                             "machine, date and settings kept): no deployment")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (--launch)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=256)
    p.add_argument("--kv-bytes-per-token", type=int, default=None,
                   help="--server: the model's KV bytes per token (--launch reads it from the router)")
    p.add_argument("--shared-cores", default="auto",
                   help="cores the workers share ('auto': this machine's; 'none': a device each, as GPUs)")
    p.add_argument("--out", default="profile.json")

    p = sub.add_parser("simulate", help="predict TTFT/ITL, goodput and utilisation of a layout on a trace")
    _add_trace_args(p)
    p.add_argument("--layout", nargs="+", default=["1p1d"], help="NpMd or Nc, as pdserve bench --launch")

    p = sub.add_parser("size", help="the cheapest (P, D), or colocated N, meeting an SLO")
    _add_trace_args(p)
    p.add_argument("--max-pool-size", type=int, default=64, help="the most workers a pool may have")
    p.add_argument("--no-colocated", action="store_true", help="search disaggregated layouts only")
    p.add_argument("--as-profiled", action="store_true",
                   help="size for the machine the profile was taken on: its workers share its cores (every "
                        "layout up to --max-pool-size, at most 6, is simulated); default: a device a worker")
    p = sub.add_parser("watch", help="autoscale: read live rates, forecast, re-plan, advise or scale (--apply)")
    p.add_argument("--server", default="127.0.0.1:50051", help="the deployment's gRPC address (Admin API)")
    p.add_argument("--metrics", default="http://127.0.0.1:9400/metrics", help="the router's /metrics URL")
    p.add_argument("--profile", required=True)
    p.add_argument("--slo-file", required=True, help='JSON: {"ttft_s": 2, "itl_s": 0.1, "target": 0.9}')
    p.add_argument("--interval", type=float, default=30.0, help="seconds between re-plans")
    p.add_argument("--cooldown", type=float, default=60.0, help="seconds a pool stays unchanged after a change")
    p.add_argument("--down-after", type=int, default=2,
                   help="intervals in a row that must ask for fewer workers before a pool shrinks")
    p.add_argument("--max-pool-size", type=int, default=64)
    p.add_argument("--apply", action="store_true", help="scale through the Admin API (default: advise only)")
    p.add_argument("--port", type=int, default=None, help="serve the watcher's own gauges on this port")
    p.add_argument("--rounds", type=int, default=None, help="stop after this many intervals")
    p.add_argument("--as-profiled", action="store_true",
                   help="size for the machine the profile was taken on (as `plan size --as-profiled`)")
    from router.security import add_client_args

    add_client_args(p)
    return parser


def _watch(args: argparse.Namespace) -> int:
    import logging

    from planner.autoscaler import ScalePolicy
    from planner.sizing import check_as_profiled
    from planner.watch import PoolsClient, WatchGauges, load_slo, scrape, watch
    from router.security import client_security

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    policy = ScalePolicy(args.cooldown, args.down_after, 1, args.max_pool_size)
    if args.as_profiled:
        check_as_profiled(args.max_pool_size)
    with contextlib.suppress(KeyboardInterrupt):
        watch(PoolsClient(args.server, client_security(args)), lambda: scrape(args.metrics), Profile.load(args.profile),
              load_slo(args.slo_file), policy, args.interval, args.apply, WatchGauges(args.port), args.rounds,
              as_profiled=args.as_profiled)
    return 0


def load_profile(args: argparse.Namespace) -> Profile:
    profile = Profile.load(args.profile)
    if args.device:
        from planner.devices import on_device

        profile = on_device(profile, args.device, args.target_model)
    elif args.target_model:
        raise ValueError("--target-model goes with --device")
    return profile


def slo_of(args: argparse.Namespace) -> SLO:
    return SLO(args.ttft_slo, args.itl_slo, args.slo_target).with_margin(args.slo_margin)


def _profile(args: argparse.Namespace) -> int:
    from planner.profiler import profile_launched, profile_server, refit

    cores = {"auto": os.cpu_count(), "none": None}.get(args.shared_cores)
    if args.shared_cores not in ("auto", "none"):
        cores = int(args.shared_cores)
    engine = EngineSettings(prefill_chunk_tokens=args.prefill_chunk_tokens)
    t0 = time.monotonic()
    if args.refit:
        profile = refit(Profile.load(args.refit), args.refit)
    elif args.launch:
        profile = profile_launched(args.model, engine, cores, args.worker_threads, args.num_blocks,
                                   args.kv_bytes_per_token)
    else:
        import asyncio

        profile = asyncio.run(profile_server(args.server, engine, args.kv_bytes_per_token, cores))
    profile.save(args.out)
    p, d = profile.prefill, profile.decode
    print(f"profile of {profile.model} ({time.monotonic() - t0:.0f} s) -> {args.out}\n"
          f"  prefill step: {p.step_s * 1e3:.1f} ms + {p.token_s * 1e6:.0f} us/token + "
          f"{p.attention_s * 1e9:.2f} ns/attention pair\n"
          f"  decode step:  {d.step_s * 1e3:.1f} ms + {d.seq_s * 1e3:.2f} ms/sequence + "
          f"{d.context_token_s * 1e6:.2f} us/context token\n"
          f"  KV link: {profile.transfer.bytes_per_s / 1e6:.0f} MB/s + {profile.transfer.latency_s * 1e3:.1f} ms; "
          f"router: {profile.router.request_s * 1e3:.1f} ms/request, {profile.router.token_s * 1e6:.0f} us CPU/token\n"
          f"  fit checks: {json.dumps(profile.samples.get('checks', {}))}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from benchmarks.serving.launch import Layout
    from planner.simulator import SimOptions, simulate
    from planner.trace import load_trace

    profile, slo = load_profile(args), slo_of(args)
    trace = load_trace(args.workload, args.rate, args.num_requests, args.seed)
    options = SimOptions(late_reservation=not args.no_late_reservation)
    rows = []
    print(f"{'layout':<8} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} {'SLO met':>8} "
          f"{'goodput':>8}  utilisation")
    for spec in args.layout:
        result = simulate(profile, Layout.parse(spec), trace, options)
        t, i = result.ttft, result.itl
        util = " ".join(f"{w}={u:.0%}" for w, u in result.utilisation.items())
        print(f"{result.layout:<8} {t.p50 * 1e3:6.0f} /{t.p90 * 1e3:6.0f} /{t.p99 * 1e3:6.0f} "
              f"{i.p50 * 1e3:5.0f} /{i.p90 * 1e3:5.0f} /{i.p99 * 1e3:5.0f} {result.attainment(slo):8.0%} "
              f"{result.goodput(slo):7.2f}/s  {util}")
        rows.append(result.summary(slo))
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "results": rows}, indent=1) + "\n")
    return 0


def _size(args: argparse.Namespace) -> int:
    from planner.sizing import format_plan, size

    profile, slo = load_profile(args), slo_of(args)
    from planner.trace import load_trace

    trace = load_trace(args.workload, args.rate, args.num_requests, args.seed)
    t0 = time.monotonic()
    plan = size(profile, trace, slo, max_pool_size=args.max_pool_size, colocated=not args.no_colocated,
                late_reservation=not args.no_late_reservation, as_profiled=args.as_profiled)
    print(format_plan(plan, slo))
    print(f"({len(plan.searched)} layouts simulated in {time.monotonic() - t0:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(slo), indent=1) + "\n")
    return 0 if plan.best is not None else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"profile": _profile, "simulate": _simulate, "size": _size, "watch": _watch}[args.command](args)
    except ValueError as e:
        print(f"pdserve plan {args.command}: {e}", file=sys.stderr)
        return 2
