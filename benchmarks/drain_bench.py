"""What a drained sequence's move costs the client: the longest token gap of a stream whose decode worker is
drained mid-stream, KV move against recompute, side by side in one run (SmolLM2, 1 prefill + 2 decode
workers, local Ray, gRPC on loopback, drains through the Admin API).

    python -m benchmarks.drain_bench [--contexts 256 1024 2048] [--rounds 1] [--max-tokens 64]
                                     [--move-after 16] [--background 0] [--json] [--out FILE]

For each context length, trials run in ABBA order per round over three methods:
- `kv`: DrainWorker(method=KV): the sequence's KV (prompt + tokens so far) moves decode -> decode;
- `recompute`: DrainWorker(method=RECOMPUTE): placed again with prompt + tokens so far, re-prefilled on the
  prefill worker, whose prefix cache still holds the prompt's blocks (what pdserve does by default);
- `recompute_cold`: the same with the prefill worker's prefix cache emptied first (a prefill worker that
  evicted the prompt, or another one): the whole context is computed again.
Each trial streams one fresh random prompt, drains its decode worker once `--move-after` tokens reached the
client, and reads the stream's longest inter-token gap (the pause); the pool then grows back to 2 decode
workers (ScalePool) outside the measurement. With `--background N`, N more clients keep the prefill worker
busy with fresh 512-token prompts throughout (a drain during traffic: a recompute waits in the prefill
queue, a KV move never touches the prefill pool). Every worker is a process on this machine's 2 cores:
compare the ratios, measured in one run, not the seconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time

import grpc

from benchmarks.output import emit
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from protos.pdserve.v1 import admin_pb2 as admin
from protos.pdserve.v1 import admin_pb2_grpc
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

METHODS = {"kv": admin.MIGRATION_METHOD_KV, "recompute": admin.MIGRATION_METHOD_RECOMPUTE,
           "recompute_cold": admin.MIGRATION_METHOD_RECOMPUTE}
ORDER = ("kv", "recompute", "recompute_cold", "recompute_cold", "recompute", "kv")  # ABC CBA


def _trial(dep: LocalDeployment, stub, admin_stub, prompt: list[int], max_tokens: int, move_after: int,
           method: str) -> dict:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    drained: dict = {}

    def drain(worker_id: str) -> None:
        if method == "recompute_cold":
            import ray

            ray.get([w.client.actor.reset_prefix_cache.remote()
                     for w in dep.server.registry.live() if w.kind.value == "prefill"])
        drained["response"] = admin_stub.DrainWorker(admin.DrainWorkerRequest(
            worker_id=worker_id, method=METHODS[method]), timeout=600)

    gaps, n, last, mover, final, drain_at = [], 0, 0.0, None, None, 0
    for r in stub.Generate(req, timeout=600):
        now = time.monotonic()
        if r.token_ids:
            if n:
                gaps.append((now - last, n))
            last = now
            n += len(r.token_ids)
        if n >= move_after and mover is None:
            # NOTE: the decode worker of *this* stream (the background's prompts also reserve decode blocks)
            holder = next(s.decode_worker for s in list(dep.server.router.requests.values())
                          if s.req.params.max_tokens == max_tokens)
            mover = threading.Thread(target=drain, args=(holder,))
            mover.start()
            drain_at = n
        final = r
    mover.join()
    # NOTE: the longest gap from the drain call on: before it, a slow step on a busy machine can be longer
    # than a short move's pause, and is not the move's cost
    pause, at = max((g, i) for g, i in gaps if i >= drain_at)
    out = drained["response"]
    assert n == max_tokens and out.clean, (n, out)
    assert (out.moved_kv, out.moved_recompute) == ((1, 0) if method == "kv" else (0, 1)), out
    # the steady gap: the median of the gaps after the move, for scale
    return {"pause_s": pause, "pause_at_token": at, "drain_at_token": drain_at,
            "steady_gap_s": statistics.median(g for g, i in gaps if i > at), "prefill_s": final.timing.prefill_seconds}


class Background:
    """`n` clients sending fresh prompts for their first token only, until stopped: a busy prefill pool."""

    def __init__(self, stub, n: int, vocab: int, prompt_tokens: int = 512) -> None:
        self.stub, self.prompt_tokens, self.vocab = stub, prompt_tokens, vocab
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        rng = random.Random(1000 + i)
        while not self.stop.is_set():
            prompt = [rng.randrange(1, self.vocab) for _ in range(self.prompt_tokens)]
            list(self.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                                       sampling=pb.SamplingParams(max_tokens=1)), timeout=600))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=1, help="ABC-CBA rounds per context")
    ap.add_argument("--order", nargs="+", choices=sorted(METHODS), default=list(ORDER),
                    help="the methods of one round, in turn (default: ABC CBA, so each sees the same drift)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--move-after", type=int, default=16)
    ap.add_argument("--background", type=int, default=0, help="clients keeping the prefill worker busy")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = ap.parse_args(argv)
    if set(args.order) != set(METHODS):
        ap.error(f"--order must name every method ({', '.join(METHODS)}): the summary compares them")
    if not 0 < args.move_after < args.max_tokens - 8:
        ap.error("--move-after must leave at least 8 tokens after the move")

    layout = Layout(1, 2)
    start_ray([layout])
    rng = random.Random(0)
    config = layout.serve_config(model=args.model, port=0, metrics_port=None, worker_threads=1, num_blocks=512,
                                 max_model_len=max(args.contexts) + args.max_tokens + 16)
    print(f"starting {layout.description} for {args.model}...", file=sys.stderr, flush=True)
    rows = []
    with LocalDeployment(config) as dep:
        channel = grpc.insecure_channel(dep.address)
        stub, admin_stub = pb_grpc.GenerationStub(channel), admin_pb2_grpc.AdminStub(channel)
        list(stub.Generate(pb.GenerateRequest(prompt="warm up", sampling=pb.SamplingParams(max_tokens=4))))
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
        background = Background(stub, args.background, vocab)
        for ctx in args.contexts:
            for rnd in range(args.rounds):
                for method in args.order:
                    admin_stub.ScalePool(admin.ScalePoolRequest(pool=pb.POOL_KIND_DECODE, num_workers=2),
                                         timeout=600)
                    prompt = [rng.randrange(1, vocab) for _ in range(ctx)]
                    row = {"context": ctx, "round": rnd, "method": method,
                           **_trial(dep, stub, admin_stub, prompt, args.max_tokens, args.move_after, method)}
                    rows.append(row)
                    print(f"context {ctx}, {method:>14}: pause {row['pause_s'] * 1e3:7.0f} ms "
                          f"(steady gap {row['steady_gap_s'] * 1e3:.0f} ms, prefill {row['prefill_s']:.2f}s)",
                          file=sys.stderr, flush=True)
        background.close()
        channel.close()

    summary: dict = {"model": args.model, "max_tokens": args.max_tokens, "move_after": args.move_after,
                     "background_clients": args.background,
                     "trials": rows, "contexts": {}}
    for ctx in args.contexts:
        med = {m: statistics.median(r["pause_s"] for r in rows if r["context"] == ctx and r["method"] == m)
               for m in METHODS}
        summary["contexts"][ctx] = {
            **{f"pause_{m}_s": v for m, v in med.items()},
            "recompute_over_kv": med["recompute"] / med["kv"],
            "recompute_cold_over_kv": med["recompute_cold"] / med["kv"],
            "steady_gap_s": statistics.median(r["steady_gap_s"] for r in rows if r["context"] == ctx)}
    emit(summary, args.out, args.json, _table)
    return 0


def _table(summary: dict) -> str:
    lines = [f"{'context':>8} {'kv pause':>10} {'recompute':>10} {'cold':>10} {'recompute/kv':>13} {'cold/kv':>8}"]
    for ctx, s in summary["contexts"].items():
        lines.append(f"{ctx:>8} {s['pause_kv_s'] * 1e3:>8.0f}ms {s['pause_recompute_s'] * 1e3:>8.0f}ms "
                     f"{s['pause_recompute_cold_s'] * 1e3:>8.0f}ms {s['recompute_over_kv']:>12.1f}x "
                     f"{s['recompute_cold_over_kv']:>7.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
