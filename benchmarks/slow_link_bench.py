"""One slow link: does joint (prefill, decode) placement route around it, and what does the node-only rule pay?

    python -m benchmarks.slow_link_bench [--rate 50mbit] [--requests 12] [--concurrency 2 | --arrival-rate R]
                                         [--out FILE]

A real three-node Ray cluster on this machine (`python -m tests.cluster`: one network namespace per node,
veth links through a bridge): the head holds the prefill worker, nodes d1 and d2 one decode worker each.
d1's link is throttled (tbf) to `--rate`. Each layout is a fresh `pdserve` deployment on that cluster, run
from the head's namespace, serving the same sequence of prompts (distinct, so no prefix cache helps):

- `separate`: the decode worker by node (neither is on the prefill worker's node) then free blocks: with
  two prompts in flight the two alternate, so about half the prompts' KV crosses the slow link;
- `joint`: every (prefill, decode) pair scored by the cost model, whose per-pair link rate is learned from
  the KV transfers it sees (the node prior until then).

The layouts run ABBA. Reported per layout: TTFT (the first token leaves before the KV lands, so the link
barely shows there), the time to the *second* token (the first decode token: prefill + KV transfer +
admission), the KV wait between the two (where the link shows), and the share of prompts sent over the
slow link, overall and after each run's first `WARMUP` prompts (joint placement learns a pair's rate from
the transfers it sees: its first prompts may cross the slow link before it is measured). Needs root and `ip
netns` (the test suite's cluster harness); Linux only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from benchmarks.output import emit

WARMUP = 4  # prompts per run before the steady-state share is counted
SLOW_NODE_IP = "10.213.7.11"  # d1 (tests.cluster's addresses)


def _cluster(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "tests.cluster", *args], capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"tests.cluster {' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def _inner(placement: str, address: str, requests: int, prompt_tokens: int, seed: int,
           concurrency: int, arrival_rate: float | None = None, max_tokens: int = 4) -> dict:
    """One layout, from inside the head node's namespace: start it, keep `concurrency` prompts in flight,
    or, with `arrival_rate`, send one every 1/`arrival_rate` seconds (open loop) whatever is in flight."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from benchmarks.serving.launch import LocalDeployment
    from control.config import ServeConfig
    from control.ray_cluster import init_ray
    from protos.pdserve.v1 import generation_pb2 as pb
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

    init_ray(address, 3)
    config = ServeConfig(model="smollm2-135m", ray_address=address, port=0, metrics_port=None, http_port=None,
                         worker_threads=1, num_blocks=256, prefill_workers=1, decode_workers=2,
                         prefill_resources={"CPU": 1, "prefill_node": 1},
                         decode_resources={"CPU": 1, "decode_node": 1}, placement=placement)
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_tokens)] for _ in range(requests)]
    with LocalDeployment(config) as dep:
        node_ip = {w.worker_id: w.info.node_ip for w in dep.server.registry.live()}
        with grpc.insecure_channel(dep.address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            start = time.perf_counter()

            def one(i: int) -> dict:
                if arrival_rate:
                    time.sleep(max(0.0, start + i / arrival_rate - time.perf_counter()))
                req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompts[i]),
                                         sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True))
                t0, times, last = time.perf_counter(), [], None
                for res in stub.Generate(req, timeout=600):
                    times += [time.perf_counter() - t0] * len(res.token_ids)
                    last = res
                print(f"  {placement} request {i + 1}/{requests}: to {last.decode_worker_id}, second token "
                      f"at {times[1]:.2f}s", file=sys.stderr, flush=True)
                return {"ttft_s": times[0], "second_token_s": times[1], "decode": last.decode_worker_id,
                        "slow_link": node_ip[last.decode_worker_id] == SLOW_NODE_IP}

            with ThreadPoolExecutor(requests if arrival_rate else concurrency) as pool:
                rows = list(pool.map(one, range(requests)))
    return {"placement": placement, "concurrency": None if arrival_rate else concurrency,
            "arrival_rate": arrival_rate, "requests": rows}


def _summary(runs: list[dict]) -> dict:
    out = {}
    for placement in dict.fromkeys(r["placement"] for r in runs):
        rows = [x for r in runs if r["placement"] == placement for x in r["requests"]]
        steady = [x for r in runs if r["placement"] == placement for x in r["requests"][WARMUP:]]
        out[placement] = {
            "requests": len(rows),
            "ttft_p50_s": statistics.median(x["ttft_s"] for x in rows),
            "second_token_p50_s": statistics.median(x["second_token_s"] for x in rows),
            "second_token_mean_s": statistics.fmean(x["second_token_s"] for x in rows),
            "second_token_steady_p50_s": statistics.median(x["second_token_s"] for x in steady)
            if steady else float("nan"),
            "kv_wait_mean_s": statistics.fmean(x["second_token_s"] - x["ttft_s"] for x in rows),
            "kv_wait_steady_mean_s": statistics.fmean(x["second_token_s"] - x["ttft_s"] for x in steady)
            if steady else float("nan"),
            "slow_link_share": sum(x["slow_link"] for x in rows) / len(rows),
            "slow_link_share_steady": sum(x["slow_link"] for x in steady) / len(steady) if steady else float("nan"),
        }
    if {"separate", "joint"} <= out.keys():
        out["joint_vs_separate_kv_wait_steady"] = (out["separate"]["kv_wait_steady_mean_s"]
                                                   / out["joint"]["kv_wait_steady_mean_s"])
    return out


def _table(summary: dict) -> str:
    s = summary["summary"]
    lines = [f"d1's link at {summary['rate']}; {summary['prompt_tokens']}-token prompts; "
             f"{summary.get('load', 'closed loop')}",
             "| placement | TTFT p50 | second token p50 / mean | second token p50 after warm-up | "
             "KV wait mean: all / after warm-up | over the slow link: all / after warm-up |",
             "|---|---|---|---|---|---|"]
    for p in ("separate", "joint"):
        if p in s:
            r = s[p]
            lines.append(f"| {p} | {r['ttft_p50_s']:.2f} s | {r['second_token_p50_s']:.2f} / "
                         f"{r['second_token_mean_s']:.2f} s | {r['second_token_steady_p50_s']:.2f} s | "
                         f"{r['kv_wait_mean_s']:.2f} / "
                         f"{r['kv_wait_steady_mean_s']:.2f} s | {r['slow_link_share']:.0%} / "
                         f"{r['slow_link_share_steady']:.0%} |")
    if "joint_vs_separate_kv_wait_steady" in s:
        lines.append(f"after warm-up, joint's mean KV wait is {s['joint_vs_separate_kv_wait_steady']:.1f}x shorter")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="50mbit", help="d1's link rate (tc tbf syntax)")
    ap.add_argument("--requests", type=int, default=12, help="prompts per layout run")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates (longer: requests "
                    "overlap on the decode workers, and free blocks differ between them)")
    ap.add_argument("--concurrency", type=int, default=2, help="prompts in flight (closed loop)")
    ap.add_argument("--arrival-rate", type=float, default=None, metavar="PER_S",
                    help="open loop instead: a prompt every 1/PER_S seconds, whatever is in flight (then the "
                         "prefill worker does the same work in both layouts, and only where the KV goes differs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, metavar="FILE")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # placement, run in the head's namespace
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        print("RESULT " + json.dumps(_inner(args.inner, args.address, args.requests, args.prompt_tokens,
                                            args.seed, args.concurrency, args.arrival_rate,
                                            args.max_tokens)), flush=True)
        return 0

    from tests.cluster import NetnsCluster

    print("starting the three-node cluster...", file=sys.stderr, flush=True)
    up = _cluster("up")
    address = up.split("Ray head at ", 1)[1].split(";", 1)[0].strip()
    runs = []
    try:
        _cluster("throttle", "d1", args.rate)
        for placement in ("separate", "joint", "joint", "separate"):  # ABBA
            print(f"layout {placement}...", file=sys.stderr, flush=True)
            inner = ["--inner", placement, "--address", address, "--requests", str(args.requests),
                     "--prompt-tokens", str(args.prompt_tokens), "--seed", str(len(runs) // 2),
                     "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
                     *(["--arrival-rate", str(args.arrival_rate)] if args.arrival_rate else [])]
            # NOTE: through `popen`, the run on the head holds the cluster's Ray token (`up` made it)
            proc = NetnsCluster().popen("head", [sys.executable, "-m", "benchmarks.slow_link_bench", *inner],
                                        stdout=subprocess.PIPE, text=True)
            stdout = proc.communicate(timeout=1800)[0]
            lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"the {placement} run failed (exit {proc.returncode})")
            runs.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        _cluster("down")
    load = (f"a prompt every {1 / args.arrival_rate:.2f} s" if args.arrival_rate else f"{args.concurrency} in flight")
    load += f", {args.max_tokens} tokens out"
    summary = {"rate": args.rate, "prompt_tokens": args.prompt_tokens, "load": load, "runs": runs,
               "summary": _summary(runs)}
    emit(summary, args.out, args.json, _table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
