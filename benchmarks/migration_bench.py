"""What a migration costs: a request whose decode worker is SIGKILLed mid-stream against its undisturbed
twin, on a real 1P+2D deployment of SmolLM2 (local Ray, gRPC on loopback).

    python -m benchmarks.migration_bench [--trials 3] [--prompt-tokens 512] [--max-tokens 96]
                                          [--kill-after 32] [--json] [--out FILE]

Each trial sends two requests with fresh random prompts of the same length, one after the other (cold
prefix caches, the same load): the twin runs undisturbed; the other has its decode worker's process
killed once `--kill-after` tokens reached the client, so the router re-prefills prompt + those tokens on
the prefill worker and resumes on the other decode worker. Reported, per trial and as the median:
- extra latency = e2e(migrated) - e2e(twin), and that as a ratio of the twin's prefill time;
- the pause the client saw (the longest gap between two tokens of the migrated stream).
Between trials the pool is let grow back to 2 decode workers. Every worker is a process on this machine's
2 cores, so absolute seconds depend on the neighbours; the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time

import grpc

from benchmarks.output import emit
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc


def _request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _stream(stub, prompt: list[int], max_tokens: int, on_tokens=None) -> dict:
    t0 = time.monotonic()
    last, gaps, n, final = t0, [], 0, None
    for r in stub.Generate(_request(prompt, max_tokens), timeout=600):
        now = time.monotonic()
        if r.token_ids:
            if n:
                gaps.append(now - last)
            last = now
            n += len(r.token_ids)
            if on_tokens is not None:
                on_tokens(n, r)
        final = r
    return {"e2e": time.monotonic() - t0, "tokens": n, "max_gap": max(gaps, default=0.0),
            "prefill": final.timing.prefill_seconds, "decode_worker": final.decode_worker_id}


def _wait_pool(server, n: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while len(server.registry.live(_decode_kind())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the decode pool did not grow back to {n} within {timeout:.0f}s")
        time.sleep(0.2)


def _decode_kind():
    from router.placement import PoolKind

    return PoolKind.DECODE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kill-after", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file (Ray's worker-death "
                    "notices share stdout)")
    args = ap.parse_args(argv)
    if not 0 < args.kill_after < args.max_tokens:
        ap.error("--kill-after must be between 0 and --max-tokens")

    layout = Layout(1, 2)
    start_ray([layout])
    rng = random.Random(0)
    rows = []
    config = layout.serve_config(model=args.model, port=0, metrics_port=None, worker_threads=1,
                                 num_blocks=256, worker_timeout=10.0)
    print(f"starting {layout.description} for {args.model}...", file=sys.stderr, flush=True)
    with LocalDeployment(config) as dep:
        server = dep.server
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(dep.address))
        _stream(stub, [rng.randrange(100, 40000) for _ in range(32)], 4)  # warm up both paths
        for trial in range(args.trials):
            _wait_pool(server, 2)
            twin = _stream(stub, [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)], args.max_tokens)
            killed = {}

            def kill_decode(n: int, r, killed=killed) -> None:
                if n >= args.kill_after and not killed:
                    victim = next(w for w in server.registry.live(_decode_kind()) if w.load.num_running)
                    killed["worker"] = victim.worker_id
                    os.kill(victim.info.pid, signal.SIGKILL)

            moved = _stream(stub, [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)],
                            args.max_tokens, kill_decode)
            extra = moved["e2e"] - twin["e2e"]
            row = {"trial": trial, "twin_e2e_s": twin["e2e"], "migrated_e2e_s": moved["e2e"],
                   "twin_prefill_s": twin["prefill"], "extra_s": extra,
                   "extra_over_prefill": extra / twin["prefill"] if twin["prefill"] else float("nan"),
                   "pause_s": moved["max_gap"], "twin_max_gap_s": twin["max_gap"],
                   "killed": killed.get("worker"), "resumed_on": moved["decode_worker"],
                   "tokens": moved["tokens"]}
            assert moved["tokens"] == twin["tokens"] == args.max_tokens, row
            rows.append(row)
            print(f"trial {trial + 1}/{args.trials}: extra {extra:.2f}s = {row['extra_over_prefill']:.2f}x "
                  f"prefill ({twin['prefill']:.2f}s), pause {moved['max_gap']:.2f}s "
                  f"({row['killed']} -> {row['resumed_on']})", file=sys.stderr, flush=True)
    summary = {"model": args.model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "kill_after": args.kill_after, "trials": rows,
               "median_extra_over_prefill": statistics.median(r["extra_over_prefill"] for r in rows),
               "median_pause_s": statistics.median(r["pause_s"] for r in rows),
               "median_twin_prefill_s": statistics.median(r["twin_prefill_s"] for r in rows)}
    emit(summary, args.out, args.json, lambda s: (
        f"migration of a {args.prompt_tokens}-token prompt after {args.kill_after} tokens: extra latency "
        f"{s['median_extra_over_prefill']:.2f}x the prefill time (median of {len(rows)}), client pause "
        f"{s['median_pause_s']:.2f}s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
