"""What one tenant's overload costs another, and what a low-priority burst costs a high-priority request:
first-token latency measured side by side in one run (SmolLM2, 1 prefill + 1 decode worker, local Ray, gRPC
on loopback, three tenants from an `--api-keys` table).

    python -m benchmarks.tenant_bench [--layout 1p1d] [--prompt-tokens 256] [--probes 8] [--flood 12] [--burst 12]
                                      [--rounds 3] [--lower-class-chunk-tokens 0 128] [--json] [--out FILE]

Tenants: `flood` (at most 2 requests at a time, priority class 0), `batch` (no limits, class 0) and
`interactive` (no limits, class 9). Every prompt is fresh random tokens, so no prefix cache helps anyone.
- **idle**: `interactive` sends `--probes` requests one after another: its TTFT with the server to itself.
- **overload**: `--flood` clients of `flood` send requests in a closed loop, as fast as they are answered;
  all but 2 at a time are refused at the door (RESOURCE_EXHAUSTED). Meanwhile `interactive` probes again.
  Then the same with clients that wait out each refusal's `retry-after` (polite ones): the difference is
  what the refusals themselves cost the router's CPU. Reported: TTFT p50 over the idle p50, and how long
  the refusals took.
- **burst**: `batch` sends `--burst` prompts at once; 0.2 s later `interactive` (class 9) sends one, and
  `batch` one more at its own class 0 (the control): each round's first tokens of both, `--rounds` times.
  A higher class is computed first by the prefill worker (fair order) and admitted first by the router, so
  the high-priority request waits for at most the engine step in progress; the control waits for the burst.
  Reported: each one's TTFT minus the idle TTFT, in units of the idle prefill time of one prompt (one step:
  a prompt of `--prompt-tokens` is one prefill chunk).
Each `--lower-class-chunk-tokens` value (the class-0 prompt tokens per step while class 9 is recent; 0: the
whole step) gets a deployment of its own, one after another in one run, so the runs compare side by side; each
reports the prompt tokens per second served to the flood and to `interactive` meanwhile: what the smaller
steps cost the prefill worker is their sum, since the flood's share falls as `interactive` is served sooner.
The flooding tenant's clients run in a process of their own, as they would on another machine (the router
runs on a thread of this one). Every worker is a process on this machine's 2 cores: compare the ratios from
one run, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from benchmarks.child import CONTEXT, Child
from benchmarks.output import emit
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.security import ClientSecurity

KEYS = {"flood": "sk-bench-flood-0001", "batch": "sk-bench-batch-0001", "interactive": "sk-bench-inter-0001"}
TABLE = {"tenants": {"flood": {"max_concurrent_requests": 2, "priority": 0},
                     "batch": {"priority": 0}, "interactive": {"priority": 9}},
         "keys": [{"key": key, "tenant": tenant, "role": "client"} for tenant, key in KEYS.items()]}


class Client:
    """One tenant's channel; `first_token` sends a fresh prompt and times its first token."""

    def __init__(self, address: str, tenant: str, vocab: int, prompt_tokens: int, seed: int) -> None:
        self.channel = ClientSecurity(api_key=KEYS[tenant]).channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.rng, self.vocab, self.prompt_tokens = random.Random(seed), vocab, prompt_tokens
        self.retry_after = 0.0  # what the last refusal's `retry-after` trailer asked for, seconds

    def first_token(self, priority: int | None = None) -> tuple[str, float, float]:
        """(status code name, seconds to the first token or to the refusal, the prefill worker's seconds)."""
        prompt = [self.rng.randrange(1, self.vocab) for _ in range(self.prompt_tokens)]
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True), priority=priority)
        t0, ttft, last = time.monotonic(), None, None
        try:
            for r in self.stub.Generate(req, timeout=600):
                if ttft is None and r.token_ids:
                    ttft = time.monotonic() - t0
                last = r
        except grpc.RpcError as e:
            trailers = dict(e.trailing_metadata() or ())
            self.retry_after = float(trailers.get("retry-after", 0))
            return e.code().name, time.monotonic() - t0, 0.0
        return "OK", ttft if ttft is not None else time.monotonic() - t0, last.timing.prefill_seconds

    def close(self) -> None:
        self.channel.close()


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _flood(client: Client, stop, out: list[tuple[str, float, float, float]], polite: bool) -> None:
    while not stop.is_set():
        out.append((*client.first_token(), time.monotonic()))
        if polite and out[-1][0] == "RESOURCE_EXHAUSTED":
            stop.wait(client.retry_after)


def _flooder(address: str, vocab: int, prompt_tokens: int, clients: int, polite: bool, flooding,
             stop) -> tuple[list[tuple[str, float, float, float]], float]:
    """(In the flooding tenant's own process.) `clients` closed-loop clients until `stop`; every request's
    (status, seconds, prefill seconds, monotonic end), and the cores the clients used."""
    flooders = [Client(address, "flood", vocab, prompt_tokens, 100 + i) for i in range(clients)]
    flooded: list[tuple[str, float, float, float]] = []
    threads = [threading.Thread(target=_flood, args=(c, stop, flooded, polite), daemon=True)
               for c in flooders]
    for t in threads:
        t.start()
    flooding.set()
    t0, cpu0 = time.monotonic(), time.process_time()
    stop.wait(3600)
    cores = (time.process_time() - cpu0) / (time.monotonic() - t0)  # (what the flood's own Python cost)
    for t in threads:
        t.join(120)
    for c in flooders:
        c.close()
    return flooded, cores


def _overload(address: str, vocab: int, args: argparse.Namespace, inter: Client, polite: bool) -> dict:
    """`interactive`'s probes while `flood` floods (`polite`: its clients wait out each refusal's
    retry-after).

    NOTE: the flood runs in a process of its own, as another tenant's clients would: the router runs on a
    thread of this one, and a dozen closed-loop clients' Python here would share its GIL, each slowing the
    other (an earlier version of this bench did that: its flood was weaker than a real one)."""
    flooding, stop = CONTEXT.Event(), CONTEXT.Event()
    flood = Child(_flooder, address, vocab, args.prompt_tokens, args.flood, polite, flooding, stop)
    flooding.wait(120)
    time.sleep(1.0)  # the flood is on
    began = time.monotonic()
    probes = [inter.first_token() for _ in range(args.probes)]
    ended = time.monotonic()
    stop.set()
    flooded, flood_cores = flood.answer(300, ([], float("nan")))
    seconds = ended - began
    served = sum(code == "OK" and began <= end <= ended for code, _, _, end in flooded)
    refused = [t for code, t, _, _ in flooded if code == "RESOURCE_EXHAUSTED"]
    ttft = _p50([t for _, t, _ in probes])
    print(f"overload ({'polite' if polite else 'ignoring retry-after'}): interactive TTFT p50 {ttft * 1e3:.0f} ms; "
          f"flood: {len(flooded)} requests, {len(refused)} refused", file=sys.stderr, flush=True)
    return {"ttft_p50_s": ttft, "flood_requests": len(flooded), "flood_refused": len(refused),
            "flood_prompt_tokens_per_s": served * args.prompt_tokens / seconds,
            "interactive_prompt_tokens_per_s": len(probes) * args.prompt_tokens / seconds,
            "flood_other_errors": sorted({code for code, *_ in flooded} - {"OK", "RESOURCE_EXHAUSTED"}),
            "refusal_p50_s": _p50(refused), "refusal_max_s": max(refused, default=float("nan")),
            "flood_client_cores": flood_cores}


def _probe(client: Client, priority: int, into: dict, key: str) -> None:
    into[key] = client.first_token(priority)


def run(address: str, vocab: int, args: argparse.Namespace) -> dict:
    inter = Client(address, "interactive", vocab, args.prompt_tokens, 1)
    idle = [inter.first_token() for _ in range(args.probes)]
    if failed := sorted({code for code, _, _ in idle} - {"OK"}):
        raise SystemExit(f"tenant_bench: the idle probes failed ({', '.join(failed)}); is --prompt-tokens "
                         f"{args.prompt_tokens} within the model's context?")
    idle_ttft = _p50([t for _, t, _ in idle])
    step_s = _p50([p for _, _, p in idle])
    print(f"idle: interactive TTFT p50 {idle_ttft * 1e3:.0f} ms (prefill {step_s * 1e3:.0f} ms)",
          file=sys.stderr, flush=True)
    rude = _overload(address, vocab, args, inter, polite=False)
    polite = _overload(address, vocab, args, inter, polite=True)

    batch = [Client(address, "batch", vocab, args.prompt_tokens, 200 + i) for i in range(args.burst + 1)]
    high, low = [], []
    for rnd in range(args.rounds):
        burst = [threading.Thread(target=c.first_token, daemon=True) for c in batch[:-1]]
        for t in burst:
            t.start()
        time.sleep(0.2)  # the burst is queued and computing
        got: dict[str, tuple[str, float, float]] = {}
        probes = [threading.Thread(target=_probe, args=(inter, 9, got, "high")),
                  threading.Thread(target=_probe, args=(batch[-1], 0, got, "low"))]
        for t in probes:
            t.start()
        for t in probes + burst:
            t.join(600)
        high.append(got["high"][1])
        low.append(got["low"][1])
        print(f"burst round {rnd}: high-priority TTFT {got['high'][1] * 1e3:.0f} ms, "
              f"low-priority {got['low'][1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    for c in [inter, *batch]:
        c.close()

    return {
        "prompt_tokens": args.prompt_tokens, "probes": args.probes, "flood_clients": args.flood,
        "burst": args.burst, "rounds": args.rounds,
        "idle_ttft_p50_s": idle_ttft, "idle_prefill_p50_s": step_s,
        "overload": {**rude, "over_idle": rude["ttft_p50_s"] / idle_ttft},
        "overload_polite": {**polite, "over_idle": polite["ttft_p50_s"] / idle_ttft},
        "burst_high_ttft_s": high, "burst_low_ttft_s": low,
        "burst_high_excess_steps": (_p50(high) - idle_ttft) / step_s,
        "burst_low_excess_steps": (_p50(low) - idle_ttft) / step_s,
    }


def _text(summary: dict) -> str:
    return "\n".join(_run_text(s) for s in summary["runs"])


def _run_text(s: dict) -> str:
    lines = [f"--lower-class-chunk-tokens {s['lower_class_chunk_tokens']}:",
             f"interactive TTFT p50 with the server to itself: {s['idle_ttft_p50_s'] * 1e3:.0f} ms"]
    for key, how in (("overload", "ignoring retry-after"), ("overload_polite", "waiting out retry-after")):
        o = s[key]
        lines.append(f"  beside a tenant flooding {how}: {o['ttft_p50_s'] * 1e3:.0f} ms ({o['over_idle']:.2f}x); "
                     f"{o['flood_refused']} of its {o['flood_requests']} requests refused at the door "
                     f"(p50 {o['refusal_p50_s'] * 1e3:.1f} ms, max {o['refusal_max_s'] * 1e3:.1f} ms); "
                     f"prompt tokens/s served to it {o['flood_prompt_tokens_per_s']:.0f}, to interactive "
                     f"{o['interactive_prompt_tokens_per_s']:.0f}, together "
                     f"{o['flood_prompt_tokens_per_s'] + o['interactive_prompt_tokens_per_s']:.0f}; the "
                     f"flood's own clients used {o['flood_client_cores']:.2f} cores")
    lines.append(f"behind a burst of {s['burst']} class-0 prompts: the class-9 request waits "
                 f"{s['burst_high_excess_steps']:.1f} steps more than idle, the class-0 one "
                 f"{s['burst_low_excess_steps']:.1f} (one step: the idle prefill of one prompt, "
                 f"{s['idle_prefill_p50_s'] * 1e3:.0f} ms)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layout", default="1p1d", help="as `pdserve bench --layouts`, e.g. 1p1d:chunk128")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--probes", type=int, default=8, help="interactive requests per phase")
    ap.add_argument("--flood", type=int, default=12, help="closed-loop clients of the flooding tenant")
    ap.add_argument("--burst", type=int, default=12, help="class-0 prompts sent at once")
    ap.add_argument("--rounds", type=int, default=3, help="bursts, each with one probe of each class")
    ap.add_argument("--lower-class-chunk-tokens", type=int, nargs="+", default=[0, 128],
                    help="one deployment per value, in this order (0: class 0 takes whole steps)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = ap.parse_args(argv)

    layout = Layout.parse(args.layout)
    start_ray([layout])
    summary: dict = {"model": args.model, "layout": layout.label, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(TABLE))
        for cap in args.lower_class_chunk_tokens:
            config = layout.serve_config(model=args.model, port=0, metrics_port=None, http_port=None,
                                         worker_threads=1, num_blocks=2048, api_keys=str(keys),
                                         lower_class_chunk_tokens=cap)
            print(f"starting {layout.description} for {args.model}, --lower-class-chunk-tokens {cap}...",
                  file=sys.stderr, flush=True)
            with LocalDeployment(config) as dep:
                with ClientSecurity(api_key=KEYS["interactive"]).channel(dep.address) as channel:
                    vocab = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest()).vocab_size
                warm = Client(dep.address, "interactive", vocab, 8, 0)
                warm.first_token()  # (the first request pays for the workers' warm-up, outside the numbers)
                warm.close()
                summary["runs"].append({"lower_class_chunk_tokens": cap, **run(dep.address, vocab, args)})
    emit(summary, args.out, args.json, _text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
