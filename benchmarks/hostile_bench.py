"""What hostile clients cost a polite one: a running stream's inter-token gaps with and without each attack
beside it, side by side in one run (SmolLM2, 1 prefill + 1 decode worker, local Ray, gRPC and HTTP on
loopback), and whether the server frees what the attack held.

    python -m benchmarks.hostile_bench [--attacks huge,slowloris,stalled,tenants,priority] [--rounds 3]
                                       [--stream-tokens 64] [--slowloris 2000] [--huge-chars 262144]
                                       [--stalled 8] [--stalled-prompt 2000]
                                       [--stall-timeout 10] [--probes 8] [--flood-threads 16] [--json]
                                       [--out FILE]

Each round runs the victims alone, then once beside each attack, in that order, so every attack compares
with a baseline taken minutes apart at most. The victim is the polite tenant's: a greedy gRPC stream of
`--stream-tokens` over a short prompt (its gaps; the issue's bound: p99 moves by less than 20%), or, beside
the tenant attacks, `--probes` requests one after another, each a fresh `--probe-prompt`-token prompt (their
TTFT). Reported per attack: the victim's p50 and p99 over the baseline's, and what the attack got back. The
attackers run in processes of their own, as they would on other machines (the router runs on a thread of
this one, and an attacker's Python here would take the GIL from it):
- **huge**: one HTTP completion whose prompt is `--huge-chars` characters (52k tokens of "word "), sent
  once the victim streams. Tokenized off the event loop, then refused (400, too long for the context).
- **slowloris**: `--slowloris` connections that send half a request head and stop. The door closes each
  after `--http-header-timeout` (2 s here); counted: how many were closed by the server, and that a
  request right after is served.
- **stalled**: `--stalled` gRPC streams of `--stalled-prompt`-token prompts whose client stops reading
  (a 1 KiB HTTP/2 window, so the server's writes wait on it). Counted: seconds until every KV block is back
  (the stalled-stream timeout, `--stall-timeout` here, plus the sweeper's quarter), and the
  `pdserve_stalled_streams_cancelled_total` count.
- **tenants**: a tenant limited to `--flood-quota` requests at once sends from `--flood-threads` threads,
  each a `--flood-prompt`-token prompt after the other, waiting out each refusal's retry-after. Counted:
  how fast the door refuses it (the issue's bound: within 100 ms, before prefill); the other tenant's TTFT
  p50 (bound: within 1.5x its idle value).
- **priority**: a tenant of the lowest class sends the same burst without a quota; the victim's probes ask
  priority 1. The bound: a high-class first token waits at most one engine step longer than idle, the step
  being `--prefill-chunk-tokens` at the prefill worker's measured rate (the router's cost model, read idle).
Every process shares this machine's 2 cores, so the ratios, not the seconds, are the result.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from benchmarks.output import emit
from benchmarks.serving.client import RequestRecord
from benchmarks.serving.launch import Layout, LocalDeployment, start_ray
from benchmarks.serving.stats import percentile
from protocol.kinds import PoolKind
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

ATTACKS = ["huge", "slowloris", "stalled", "tenants", "priority"]
KEYS = {"polite": "sk-hostile-polite-0001", "flood": "sk-hostile-flood-00001",
        "batch": "sk-hostile-batch-00001"}


def key_file(args: argparse.Namespace) -> dict:
    """The victim's tenant without limits; one with a concurrency quota; one of the lowest class only."""
    return {"tenants": {"polite": {}, "flood": {"max_concurrent_requests": args.flood_quota},
                        "batch": {"priority": 0}},
            "keys": [{"key": key, "tenant": tenant, "role": "client"} for tenant, key in KEYS.items()]}


def metadata(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def request(prompt: list[int], max_tokens: int, priority: int | None = None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = pb.GenerateRequest(sampling=sampling)
    req.prompt_token_ids.ids.extend(prompt)
    if priority is not None:
        req.priority = priority
    return req


class Bench:
    def __init__(self, dep: LocalDeployment, args: argparse.Namespace) -> None:
        self.dep, self.args = dep, args
        self.channel = grpc.insecure_channel(dep.address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.vocab = self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata("polite")).vocab_size
        self.http = dep.server.http_port
        self.rng = random.Random(0)
        self.bearer = {"Authorization": f"Bearer {KEYS['polite']}"}

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    def victim(self, started: threading.Event | None = None) -> list[float]:
        """The polite stream's gaps between tokens (seconds), counted as `pdserve bench` counts them."""
        record = RequestRecord(0, "victim", 32, self.args.stream_tokens)
        for res in self.stub.Generate(request(self.prompt(32), self.args.stream_tokens), timeout=300,
                                      metadata=metadata("polite")):
            record.on_message(time.perf_counter(), len(res.token_ids))
            if started is not None and len(record.itls) >= 3:
                started.set()
        return record.itls

    def first_tokens(self, started: threading.Event | None = None,
                     priority: int | None = None) -> list[float]:
        """The polite tenant's TTFTs (seconds): `--probes` requests one after another, fresh prompts."""
        ttfts = []
        for _ in range(self.args.probes):
            t0 = time.perf_counter()
            req = request(self.prompt(self.args.probe_prompt), 2, priority)
            stream = self.stub.Generate(req, timeout=300, metadata=metadata("polite"))
            next(stream)
            ttfts.append(time.perf_counter() - t0)
            for _ in stream:
                pass
            if started is not None:
                started.set()
        return ttfts

    def step_s(self) -> float:
        """One prefill step: `--prefill-chunk-tokens` at the prefill pool's measured rate (the router's own
        cost model; read when idle, its rate is the engine's, not a queue's)."""
        router = self.dep.server.router
        rates = [router.cost.prefill_rate(w) for w, h in router.workers.items()
                 if h.alive and h.kind is PoolKind.PREFILL]
        return self.args.prefill_chunk_tokens / (sum(rates) / len(rates))

    def used_blocks(self) -> int:
        import ray

        workers = [w for w in self.dep.server.router.workers.values() if w.alive]
        reports = ray.get([w.client.actor.report.remote() for w in workers])
        return sum(r.load.total_blocks - r.load.free_blocks for r in reports)

    def wait_blocks_back(self, timeout: float) -> float | None:
        t0 = time.monotonic()
        while self.used_blocks():
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.2)
        return time.monotonic() - t0

    def beside(self, attack, victim) -> tuple[list[float], dict]:
        """The victim's numbers while `attack(ready, started, done)` runs on another thread (the victim begins
        once the attack sets `ready`, sets `started` once it is served, and `done` is set when it ends); the
        attack's own findings."""
        ready, started, done, found = threading.Event(), threading.Event(), threading.Event(), {}

        def attacker() -> None:
            try:
                found.update(attack(ready, started, done))
            except Exception as e:  # noqa: BLE001 - reported, and the victim must not wait for it
                found["error"] = repr(e)
            finally:
                ready.set()

        t = threading.Thread(target=attacker)
        t.start()
        ready.wait(600)
        try:
            numbers = victim(started)
        finally:
            done.set()
        t.join(600)
        return numbers, found

    # -- the attacks ----------------------------------------------------------------------------------

    def huge(self, ready: threading.Event, started: threading.Event, done: threading.Event) -> dict:
        ready.set()
        started.wait(60)
        body = json.dumps({"prompt": "word " * (self.args.huge_chars // 5), "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **self.bearer})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        return {"status": status, "answered_s": time.monotonic() - t0}

    def slowloris(self, ready: threading.Event, started: threading.Event, done: threading.Event) -> dict:
        # NOTE: from a process of its own, as a real attacker: 2,000 connects from a thread of this one
        # would take the GIL from the router (on a thread here) and charge the bench's cost to the door
        ctx = multiprocessing.get_context("spawn")
        armed, go = ctx.Event(), ctx.Event()
        found, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_slow_heads, args=(self.http, self.args.slowloris,
                                                  self.args.header_timeout + 1.5, armed, go, child_end))
        p.start()
        armed.wait(120)  # the child's imports are done before the victim starts
        ready.set()
        started.wait(60)
        go.set()
        result = found.recv() if found.poll(self.args.header_timeout + 120) else {"error": "no answer"}
        p.join(30)
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v1/completions",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json", **self.bearer})
        with urllib.request.urlopen(req, timeout=60) as r:
            after = r.status
        return {**result, "next_request_status": after}

    def stalled(self, ready: threading.Event, started: threading.Event, done: threading.Event) -> dict:
        cancelled = self.dep.server.observer.stalled.labels(self.dep.server.config.model, "grpc")
        before = cancelled._value.get()
        # NOTE: a 1 KiB stream window: the server's hand-over waits on this reader after ~18 messages
        ch = grpc.insecure_channel(self.dep.address, options=[("grpc.http2.bdp_probe", 0),
                                                              ("grpc.http2.lookahead_bytes", 1024)])
        stub = pb_grpc.GenerationStub(ch)
        calls = [stub.Generate(request(self.prompt(self.args.stalled_prompt), self.args.stalled_max_tokens),
                               timeout=600, metadata=metadata("polite")) for _ in range(self.args.stalled)]
        for c in calls:
            next(c)  # its first token came; then nobody reads
        t0 = time.monotonic()
        held = self.used_blocks()
        ready.set()  # the victim is the ninth client, served while these hold their blocks
        started.wait(120)
        took = self.wait_blocks_back(self.args.stall_timeout * 2 + 30)
        back = None if took is None else time.monotonic() - t0
        for c in calls:
            c.cancel()
        ch.close()
        return {"streams": len(calls), "blocks_held": held, "blocks_back_s_after_first_tokens": back,
                "cancelled": cancelled._value.get() - before}

    def tenants(self, ready: threading.Event, started: threading.Event, done: threading.Event) -> dict:
        return self._flood("flood", None, ready, done)

    def priority(self, ready: threading.Event, started: threading.Event, done: threading.Event) -> dict:
        return self._flood("batch", 0, ready, done)

    def _flood(self, tenant: str, priority: int | None, ready: threading.Event,
               done: threading.Event) -> dict:
        """`--flood-threads` clients of `tenant` in a process of their own until the victim is done."""
        ctx = multiprocessing.get_context("spawn")
        armed, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
        found, child_end = ctx.Pipe(duplex=False)
        a = self.args
        # (fresh prompts every time: a round's flood must not find the last round's in the prefix cache)
        p = ctx.Process(target=_flood, args=(self.dep.address, KEYS[tenant], priority, a.flood_threads,
                                             a.flood_prompt, a.flood_max_tokens, self.vocab,
                                             self.rng.randrange(1 << 30), armed, go, stop, child_end))
        p.start()
        armed.wait(120)
        go.set()
        time.sleep(a.flood_ramp)  # its prompts fill the prefill queue before the victim asks
        ready.set()
        done.wait(600)
        stop.set()
        result = found.recv() if found.poll(120) else {"error": "no answer"}
        p.join(30)
        self.wait_blocks_back(60)
        return result


def _flood(address: str, key: str, priority: int | None, threads: int, prompt_len: int, max_tokens: int,
           vocab: int, seed: int, armed, go, stop, out) -> None:
    """(In the attacker's process.) `threads` clients sending one request after another until `stop`; a
    refused one waits out its retry-after. Reports how many were served and how fast refusals came."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    md = (("authorization", f"Bearer {key}"),)
    lock, served, refused, errors = threading.Lock(), [0], [], []

    def client(i: int) -> None:
        rng = random.Random(seed + i)
        while not stop.is_set():
            req = request([rng.randrange(100, vocab) for _ in range(prompt_len)], max_tokens, priority)
            t0 = time.perf_counter()
            try:
                for _ in stub.Generate(req, timeout=300, metadata=md):
                    pass
                with lock:
                    served[0] += 1
            except grpc.RpcError as e:
                if stop.is_set():
                    return
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    with lock:
                        errors.append(e.code().name)
                    continue
                with lock:
                    refused.append(time.perf_counter() - t0)
                stop.wait(float(dict(e.trailing_metadata() or ()).get("retry-after", 1)))

    armed.set()
    go.wait(600)
    clients = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in clients:
        t.start()
    stop.wait(900)
    channel.close()  # cancels what is in flight
    for t in clients:
        t.join(30)
    out.send({"served": served[0], "refused": len(refused), "errors": sorted(set(errors)),
              "refused_p50_ms": percentile(refused, 50) * 1e3 if refused else None,
              "refused_max_ms": max(refused) * 1e3 if refused else None})


def _slow_heads(port: int, n: int, hold_s: float, armed, go, out) -> None:
    """(In the attacker's process.) `n` connections that send half a request head and stop; after `hold_s`,
    how many the server closed (reset, or read to EOF; still open at a 5 s read timeout: not closed)."""
    armed.set()
    go.wait(600)
    conns, refused = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
            conns.append(s)
        except ConnectionError:
            refused += 1
    time.sleep(hold_s)
    closed = 0
    for s in conns:
        s.settimeout(5)
        try:
            closed += s.recv(100) == b""  # (an answer, or still open at the timeout: not closed)
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        s.close()
    out.send({"connections": n, "closed_by_server": closed + refused})


def ratios(base: list[float], beside: list[float]) -> dict:
    return {"p50_ms": percentile(beside, 50) * 1e3, "p99_ms": percentile(beside, 99) * 1e3,
            "p50_over_baseline": percentile(beside, 50) / percentile(base, 50),
            "p99_over_baseline": percentile(beside, 99) / percentile(base, 99)}


def run(bench: Bench, args: argparse.Namespace) -> dict:
    """Each attack beside its victim, every round; the victims alone first in each round."""
    victims = {"stream_itl": bench.victim, "probe_ttft": bench.first_tokens,
               "probe_ttft_priority_1": lambda started=None: bench.first_tokens(started, priority=1)}
    every = {"huge": (bench.huge, "stream_itl"), "slowloris": (bench.slowloris, "stream_itl"),
             "stalled": (bench.stalled, "stream_itl"), "tenants": (bench.tenants, "probe_ttft"),
             "priority": (bench.priority, "probe_ttft_priority_1")}
    attacks = {name: every[name] for name in args.attacks}
    # (alone, a probe's priority changes nothing: one baseline serves both probes)
    alone = {"probe_ttft" if v.startswith("probe_ttft") else v for _, v in attacks.values()}
    base: dict[str, list[float]] = {v: [] for v in alone}
    numbers: dict[str, list[float]] = {k: [] for k in attacks}
    found: dict[str, list[dict]] = {k: [] for k in attacks}
    steps = []
    for rnd in range(args.rounds):
        for victim in base:
            base[victim] += victims[victim]()
        if "priority" in attacks:
            steps.append(bench.step_s())
        for name, (attack, victim) in attacks.items():
            print(f"round {rnd + 1}/{args.rounds}: the victim beside {name}...", file=sys.stderr, flush=True)
            g, f = bench.beside(attack, victims[victim])
            numbers[name] += g
            found[name].append(f)
        bench.wait_blocks_back(60)
    out: dict = {}
    for victim, values in base.items():
        out[f"baseline_{victim}"] = {"p50_ms": percentile(values, 50) * 1e3,
                                     "p99_ms": percentile(values, 99) * 1e3, "n": len(values)}
    for name, (_, victim) in attacks.items():
        alone_values = base["probe_ttft" if victim.startswith("probe_ttft") else victim]
        out[name] = {"victim": victim, **ratios(alone_values, numbers[name]), "rounds": found[name]}
    if "priority" in attacks:
        step = sum(steps) / len(steps)
        delay = percentile(numbers["priority"], 50) - percentile(base["probe_ttft"], 50)
        out["priority"].update(step_ms=step * 1e3, ttft_p50_delay_ms=delay * 1e3,
                               delay_over_step=delay / step)
    return out


def _text(summary: dict) -> str:
    lines = [f"{summary['model']} {summary['layout']}, the victims alone:"]
    for label in ("stream_itl", "probe_ttft"):
        if (b := summary.get(f"baseline_{label}")) is not None:
            lines.append(f"  {label}: p50 {b['p50_ms']:.0f} ms, p99 {b['p99_ms']:.0f} ms ({b['n']})")
    for name in summary["settings"]["attacks"]:
        r = summary[name]
        delay = (f"  delay {r['ttft_p50_delay_ms']:.0f} ms = {r['delay_over_step']:.2f} steps"
                 if "step_ms" in r else "")
        lines.append(f"  beside {name:9s}: p50 {r['p50_over_baseline']:.2f}x  "
                     f"p99 {r['p99_over_baseline']:.2f}x{delay}  " + "; ".join(json.dumps(f) for f in r["rounds"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layout", default="1p1d")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--slowloris", type=int, default=2000)
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--max-connections-per-client", type=int, default=256,
                    help="the HTTP door's cap on one address's connections (0: none; default %(default)s)")
    ap.add_argument("--huge-chars", type=int, default=262_144)
    ap.add_argument("--stalled", type=int, default=8)
    ap.add_argument("--stalled-prompt", type=int, default=2000)
    ap.add_argument("--stalled-max-tokens", type=int, default=4000)
    ap.add_argument("--stall-timeout", type=float, default=10.0)
    ap.add_argument("--probes", type=int, default=8, help="TTFT probes per round beside the tenant attacks")
    ap.add_argument("--probe-prompt", type=int, default=128)
    ap.add_argument("--flood-threads", type=int, default=16)
    ap.add_argument("--flood-quota", type=int, default=4,
                    help="the flooding tenant's max_concurrent_requests")
    ap.add_argument("--flood-prompt", type=int, default=1500)
    ap.add_argument("--flood-max-tokens", type=int, default=8)
    ap.add_argument("--flood-ramp", type=float, default=3.0, help="seconds of flood before the victim asks")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=256)
    ap.add_argument("--attacks", type=lambda v: v.split(","), default=ATTACKS,
                    help="which attacks, comma-separated (default: %(default)s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = ap.parse_args(argv)
    if unknown := set(args.attacks) - set(ATTACKS):
        ap.error(f"--attacks: no attack named {', '.join(sorted(unknown))} "
                 f"(choose from {', '.join(ATTACKS)})")

    layout = Layout.parse(args.layout)
    start_ray([layout])
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps(key_file(args)))
    config = layout.serve_config(model=args.model, port=0, metrics_port=0, http_port=0, worker_threads=1,
                                 num_blocks=2048, stalled_stream_timeout=args.stall_timeout,
                                 http_header_timeout=args.header_timeout,
                                 http_max_connections_per_client=args.max_connections_per_client,
                                 prefill_chunk_tokens=args.prefill_chunk_tokens, api_keys=keys)
    print(f"starting {layout.description} for {args.model}...", file=sys.stderr, flush=True)
    with LocalDeployment(config) as dep:
        bench = Bench(dep, args)
        bench.victim()  # (the first request pays for the workers' warm-up, outside the numbers)
        summary = {"model": args.model, "layout": layout.label, "settings": vars(args), **run(bench, args)}
    emit(summary, args.out, args.json, _text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
