"""`pdserve bench`: the same workloads against several server layouts, side by side, in one invocation.

    pdserve bench --launch 1p1d 2c --workload burst --concurrency 4 --num-requests 60
    pdserve bench --server 127.0.0.1:50051 --workload chat --rate 2 --num-requests 100
    pdserve bench --launch 1p1d 2c --workload chat rag --rate 1 --goodput --ttft-slo 2 --itl-slo 0.1

`--launch` starts each layout in turn on one local Ray cluster (see `launch`), runs every workload on it,
and stops it before the next; `--server` measures a running deployment. Results: a table on stdout,
`OUT.json` and `OUT.png` (`--out`). Progress and server logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.serving.client import RunResult, run_load
from benchmarks.serving.goodput import GoodputSearch, Probe
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from benchmarks.serving.load import Load
from benchmarks.serving.report import LayoutRun, format_table, plot, write_json
from benchmarks.serving.stats import SLO, itls, summarize, ttfts
from benchmarks.serving.workloads import Vocab, Workload, make_workload

WARMUP_SEED_OFFSET = 10_000  # warmup prompts never repeat a measured prompt (no prefix-cache head start)


def build_parser(prog: str = "pdserve bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--server", metavar="HOST:PORT", help="measure a running pdserve server")
    target.add_argument("--launch", nargs="+", metavar="LAYOUT",
                        help="start these layouts in turn and measure each: NpMd (N prefill + M decode workers) "
                             "or Nc (N colocated), optionally :round-robin, e.g. 1p1d 2c 2p1d:round-robin")
    p.add_argument("--workload", nargs="+", default=["chat"],
                   help="chat, rag, agent, burst, or a .jsonl file of {\"prompt_len\", \"output_len\"} lines")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests per second")
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight (default 4)")
    p.add_argument("--num-requests", type=int, default=100, help="send at most this many per run")
    p.add_argument("--duration", type=float, default=None, help="send nothing after this many seconds per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests, one at a time, before each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--itl-slo", type=float, default=0.1,
                   help="seconds, on each request's mean inter-token gap (default 0.1)")
    p.add_argument("--goodput", action="store_true",
                   help="also search the highest rate meeting the SLOs, starting at --rate")
    p.add_argument("--goodput-probes", type=int, default=5, help="runs per search, the --rate run included")
    p.add_argument("--goodput-target", type=float, default=0.9, help="share of requests meeting both SLOs")
    p.add_argument("--out", default=None,
                   help="write OUT.json and OUT.png (default bench-results/bench-<time>)")
    p.add_argument("--title", default="", help="the figure's title")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="after the last send, give up on requests still streaming after this many seconds")
    srv = p.add_argument_group("layouts started with --launch")
    srv.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, an HF dir or a .gguf")
    srv.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    srv.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--max-num-batched-tokens", type=int, default=512, help="decode/colocated step budget")
    srv.add_argument("--kv-transport", choices=["torch", "ray"], default="torch")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slo = SLO(args.ttft_slo, args.itl_slo)
        workloads = [make_workload(w) for w in args.workload]
        layouts = [Layout.parse(s) for s in args.launch] if args.launch else []
        load = Load(rate=args.rate, concurrency=None if args.rate else (args.concurrency or 4),
                    num_requests=args.num_requests, duration_s=args.duration, seed=args.seed)
        if args.goodput and not args.rate:
            raise ValueError("--goodput searches open-loop rates: give the starting --rate")
        search = (GoodputSearch(args.rate, args.goodput_probes, args.goodput_target) if args.goodput else None)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out or f"bench-results/bench-{time.strftime('%Y%m%d-%H%M%S')}")

    try:
        runs = run_all(args, layouts, workloads, load, slo, search)
    except ValueError as e:  # a workload that does not fit the served model, a bad layout option
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    print(format_table(runs, slo))
    command = "pdserve bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    write_json(out.with_suffix(".json"), runs, slo, command, _settings(args))
    title = args.title or f"{', '.join(args.workload)} on {args.model if args.launch else args.server}"
    plot(out.with_suffix(".png"), runs, slo, title)
    _log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def run_all(args: argparse.Namespace, layouts: list[Layout], workloads: list[Workload], load: Load, slo: SLO,
            search: GoodputSearch | None) -> list[LayoutRun]:
    if args.server:
        return asyncio.run(bench_server(args.server, None, workloads, load, slo, search, args))
    options = dict(model=args.model, port=0, metrics_port=None, worker_threads=args.worker_threads,
                   num_blocks=args.num_blocks, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_transport=args.kv_transport)
    configs = [layout.serve_config(**options) for layout in layouts]  # bad options fail before Ray starts
    start_ray(layouts)
    runs: list[LayoutRun] = []
    for layout, config in zip(layouts, configs):
        _log(f"starting layout {layout.label} ({layout.description})")
        with LocalDeployment(config) as deployment:
            runs += asyncio.run(bench_server(deployment.address, layout, workloads, load, slo, search, args))
    return runs


async def bench_server(address: str, layout: Layout | None, workloads: list[Workload], load: Load, slo: SLO,
                       search: GoodputSearch | None, args: argparse.Namespace) -> list[LayoutRun]:
    """Every workload against one server, in order."""
    import grpc

    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        vocab = Vocab.for_model(info.vocab_size)
        label, description = (layout.label, layout.description) if layout else _describe(info, address)
        for w in workloads:
            w.check_fits(info.max_model_len)
        return [await bench_workload(stub, vocab, label, description, w, load, slo, search, args) for w in workloads]


async def bench_workload(stub, vocab: Vocab, label: str, description: str, workload: Workload, load: Load,
                         slo: SLO, search: GoodputSearch | None, args: argparse.Namespace) -> LayoutRun:
    """One workload on one server: warmup, the run at `load`, then the goodput search if asked."""

    async def measure(run: Load, seed: int, what: str) -> RunResult:
        specs = workload.requests(run.num_requests, seed, vocab)
        return await run_load(stub, specs, run, id_prefix=f"{workload.name}-{seed}",
                              request_timeout_s=args.request_timeout, drain_timeout_s=args.drain_timeout,
                              progress=not args.no_progress, desc=f"{label} {workload.name} {what}")

    if args.warmup:
        await measure(Load(concurrency=1, num_requests=args.warmup), args.seed + WARMUP_SEED_OFFSET, "warmup")
    result = _layout_run(label, description, workload.name, await measure(load, args.seed, load.label), slo)
    s = result.summary
    _log(f"{label} {workload.name} {load.label}: {s.num_completed}/{s.num_sent} ok, SLO met {s.slo_attainment:.0%}")
    if search is None:
        return result
    probes = [Probe(load.rate, s.slo_attainment)]
    result.probes.append(_probe_dict(load.rate, s))
    while (rate := search.next_rate(probes)) is not None:
        seed = args.seed + len(probes)  # fresh prompts and arrivals for every probe
        probe = Load(rate=rate, num_requests=load.num_requests, duration_s=load.duration_s, seed=seed)
        summary = summarize(await measure(probe, seed, f"probe {rate:.2f} req/s"), slo)
        probes.append(Probe(rate, summary.slo_attainment))
        result.probes.append(_probe_dict(rate, summary))
        _log(f"{label} {workload.name} goodput probe {rate:.3g} req/s: SLO met {summary.slo_attainment:.0%}")
    result.goodput = search.result(probes)
    return result


def _layout_run(label: str, description: str, workload: str, result: RunResult, slo: SLO) -> LayoutRun:
    by_kind = defaultdict(list)
    for r in result.records:
        by_kind[r.kind].append(r)
    kinds = {}
    if len(by_kind) > 1:
        kinds = {k: summarize(RunResult(result.load, recs, result.started_at, result.finished_at), slo)
                 for k, recs in sorted(by_kind.items())}
    return LayoutRun(label, description, workload, result.load.label, summarize(result, slo),
                     ttfts(result.records), itls(result.records), kinds)


def _probe_dict(rate: float, summary) -> dict:
    return {"rate": rate, "slo_attainment": summary.slo_attainment, "summary": summary.to_dict()}


def _describe(info, address: str) -> tuple[str, str]:
    from protos.pdserve.v1 import generation_pb2 as pb

    n = {pool.kind: len(pool.workers) for pool in info.pools}
    if n.get(pb.POOL_KIND_COLOCATED):
        shape = f"{n[pb.POOL_KIND_COLOCATED]}c"
    else:
        shape = f"{n.get(pb.POOL_KIND_PREFILL, 0)}p{n.get(pb.POOL_KIND_DECODE, 0)}d"
    return f"{shape}@{address}", f"{info.model_name} at {address}"


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("no_progress",)}


def _log(msg: str) -> None:
    print(f"pdserve bench: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
