"""`pdserve bench`: the same workloads against several server layouts, side by side, in one invocation.

    pdserve bench --launch 1p1d 2c --workload burst --concurrency 4 --num-requests 60
    pdserve bench --server 127.0.0.1:50051 --workload chat --rate 2 --num-requests 100
    pdserve bench --launch 1p1d 2c --workload chat rag --rate 1 --goodput --ttft-slo 2 --itl-slo 0.1

`--launch` starts every layout in this process on one local Ray cluster (see `launch`) and offers each
workload's requests to them in alternating rounds (see `compare`); `--server` measures a running
deployment. Results: a table on stdout, `OUT.json` and `OUT.png` (`--out`). Progress and server logs go to
stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
from pathlib import Path

from benchmarks.serving.compare import Plan, Target, compare
from benchmarks.serving.goodput import GoodputSearch
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from benchmarks.serving.load import Load
from benchmarks.serving.report import LayoutRun, format_probes, format_table, plot, write_json
from benchmarks.serving.stats import SLO
from benchmarks.serving.workloads import Vocab, make_workload
from router.security import ClientSecurity, add_client_args, client_security


def build_parser(prog: str = "pdserve bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--server", metavar="HOST:PORT", help="measure a running server: pdserve over gRPC "
                        "(HOST:PORT; TLS and API-key flags below), or with --backend openai any OpenAI-compatible "
                        "server (http://HOST:PORT)")
    target.add_argument("--launch", nargs="+", metavar="LAYOUT",
                        help="start these layouts in turn and measure each: NpMd (N prefill + M decode workers) "
                             "or Nc (N colocated), optionally :round-robin, :separate (two-step placement) or "
                             ":local (local prefill), and :early (decode blocks reserved at placement, not as "
                             "the prefill nears its end), and :vllm (vLLM engines), e.g. 1p1d 2c 2p1d:round-robin 2p1d:local "
                             "2p1d:early 1p1d:vllm")
    p.add_argument("--workload", nargs="+", default=["chat"],
                   help="chat, rag, agent, burst, or a .jsonl file of {\"prompt_len\", \"output_len\"} lines")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests per second")
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight (default 4)")
    p.add_argument("--num-requests", type=int, default=100, help="send at most this many per run")
    p.add_argument("--duration", type=float, default=None, help="send nothing after this many seconds per run")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured requests, one at a time, per server and workload before measuring")
    p.add_argument("--rounds", type=int, default=2,
                   help="split each run into this many slices, offered to the layouts in ABBA order (default 2)")
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
    p.add_argument("--memory-probe", action="store_true",
                   help="record one core's memory bandwidth and matrix-multiply rate before and after each "
                        "run (2 s each time; `benchmarks.serving.cpu.machine_speed`)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="after the last send, give up on requests still streaming after this many seconds")
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                   help="how to reach --server: pdserve's gRPC, or the OpenAI HTTP API (/v1/completions, "
                        "streamed token-id prompts)")
    p.add_argument("--served-model", default=None,
                   help="--backend openai: the model name to send (default: the server's first in /v1/models)")
    add_client_args(p)
    srv = p.add_argument_group("layouts started with --launch")
    srv.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, an HF dir or a .gguf")
    srv.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker")
    srv.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    srv.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                     help="each worker's KV cache in bytes, instead of --num-blocks (with :kv-DTYPE layouts: "
                          "the same memory, the blocks its dtype fits)")
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
        load = Load(rate=args.rate, concurrency=None if args.rate else (args.concurrency or 4),
                    num_requests=args.num_requests, duration_s=args.duration, seed=args.seed)
        if args.goodput and not args.rate:
            raise ValueError("--goodput searches open-loop rates: give the starting --rate")
        plan = Plan(tuple(make_workload(w) for w in args.workload), load, slo,
                    GoodputSearch(args.rate, args.goodput_probes, args.goodput_target) if args.goodput else None,
                    rounds=args.rounds, warmup=args.warmup, seed=args.seed, request_timeout_s=args.request_timeout,
                    drain_timeout_s=args.drain_timeout, progress=not args.no_progress,
                    memory_probe=args.memory_probe)
        layouts = [Layout.parse(s) for s in args.launch] if args.launch else []
        if len({layout.label for layout in layouts}) < len(layouts):
            raise ValueError("--launch: each layout at most once")
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out or f"bench-results/bench-{time.strftime('%Y%m%d-%H%M%S')}")

    try:
        runs = run_all(args, layouts, plan)
    except ValueError as e:  # a workload that does not fit the served model, a bad layout option
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    print(format_table(runs, slo))
    if plan.search is not None:
        print(format_probes(runs))
    command = "pdserve bench " + shlex.join(_redacted(sys.argv[1:] if argv is None else argv))
    write_json(out.with_suffix(".json"), runs, slo, command, _settings(args))
    title = args.title or f"{', '.join(args.workload)} on {args.model if args.launch else args.server}"
    plot(out.with_suffix(".png"), runs, slo, title)
    _log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def run_all(args: argparse.Namespace, layouts: list[Layout], plan: Plan) -> list[LayoutRun]:
    """Start the layouts (every one stays up until the end; see `compare`), then compare."""
    if args.server and args.backend == "openai":
        return asyncio.run(_bench_openai(args.server, plan, client_security(args), args.served_model))
    if args.backend == "openai":
        raise ValueError("--backend openai measures a running server: pass --server http://HOST:PORT")
    if args.server:
        return asyncio.run(_bench([(None, args.server)], plan, client_security(args)))
    options = dict(model=args.model, port=0, metrics_port=None, worker_threads=args.worker_threads,
                   num_blocks=args.num_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_transport=args.kv_transport)
    configs = [layout.serve_config(**options) for layout in layouts]  # bad options fail before Ray starts
    start_ray(layouts)
    with contextlib.ExitStack() as stack:
        servers = []
        for layout, config in zip(layouts, configs):
            _log(f"starting layout {layout.label} ({layout.description})")
            servers.append((layout, stack.enter_context(LocalDeployment(config)).address))
        return asyncio.run(_bench(servers, plan))


async def _bench(servers: list[tuple[Layout | None, str]], plan: Plan,
                 security: ClientSecurity | None = None) -> list[LayoutRun]:
    security = security or ClientSecurity()
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with contextlib.AsyncExitStack() as stack:
        targets = []
        for layout, address in servers:
            channel = await stack.enter_async_context(security.aio_channel(address))
            stub = pb_grpc.GenerationStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            for w in plan.workloads:
                w.check_fits(info.max_model_len)
            label, description = (layout.label, layout.description) if layout else _describe(info, address)
            targets.append(Target(label, description, stub, Vocab.for_model(info.vocab_size)))
        return await compare(targets, plan)


async def _bench_openai(url: str, plan: Plan, security: ClientSecurity, model: str | None) -> list[LayoutRun]:
    import ssl

    import aiohttp

    from benchmarks.serving.openai_client import OpenAIBackend

    context = None
    if security.tls:  # https with the same --tls-ca (and mutual-TLS --tls-cert/--tls-key) as the gRPC door
        context = ssl.create_default_context(cafile=str(security.tls_ca) if security.tls_ca else None)
        if security.tls_cert is not None:
            context.load_cert_chain(str(security.tls_cert), str(security.tls_key))
    connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
    async with aiohttp.ClientSession(connector=connector) as session:  # the load sets the concurrency
        backend = OpenAIBackend(session, url, security.api_key, model)
        card = await backend.describe()
        for w in plan.workloads:
            if card.max_model_len:
                w.check_fits(card.max_model_len)
        target = Target(f"openai@{url}", f"{card.id} at {url} (OpenAI API)", backend, Vocab.for_model(card.vocab_size))
        return await compare([target], plan)


def _describe(info, address: str) -> tuple[str, str]:
    from protos.pdserve.v1 import generation_pb2 as pb

    n = {pool.kind: len(pool.workers) for pool in info.pools}
    if n.get(pb.POOL_KIND_COLOCATED):
        shape = f"{n[pb.POOL_KIND_COLOCATED]}c"
    else:
        shape = f"{n.get(pb.POOL_KIND_PREFILL, 0)}p{n.get(pb.POOL_KIND_DECODE, 0)}d"
    return f"{shape}@{address}", f"{info.model_name} at {address}"


def _settings(args: argparse.Namespace) -> dict:
    return {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()
            if k not in ("no_progress",)}


def _redacted(argv: list[str]) -> list[str]:
    """The command line as written to the results, without the API key (they are kept and shared)."""
    out, hide = [], False
    for a in argv:
        out.append("<redacted>" if hide else ("--api-key=<redacted>" if a.startswith("--api-key=") else a))
        hide = a == "--api-key"
    return out


def _log(msg: str) -> None:
    print(f"pdserve bench: {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
