"""What the router itself costs per token: the real router and gRPC door in front of fake workers that make
tokens as fast as asked, driven by real gRPC clients in other processes.

    python -m benchmarks.router_bench [--concurrency 1 32 256] [--tokens 200] [--step-ms 10] [--json]

The router process runs `Router` + `GenerationServicer` (validation, detokenizing with SmolLM2's real
tokenizer, stop strings, metrics) on its event loop, over in-process fake prefill and decode workers: the
prefill worker answers at once, the decode worker emits one token for every running sequence each
`--step-ms`. Client processes (2, so the client side is not the bottleneck) keep `concurrency` greedy
streams of `--tokens` tokens open. Reported per concurrency: relayed tokens/s, the router process's CPU
milliseconds per relayed token (user + system, all its threads, from /proc), and the client-side TTFT and
ITL percentiles (ITL minus the step time is what the router adds). Every process shares this machine's
2 cores, so compare the rows of one run; the ms-per-token figure is the one that carries to other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator

from benchmarks import child
from benchmarks.output import emit

BLOCK = 16


def _fake_worker_classes():
    from protocol import FinishReason, PoolKind
    from protocol.messages import (
        EngineLoad,
        FirstToken,
        Heartbeat,
        LoadReport,
        PrefillResult,
        Reservation,
        StepOutput,
        TokenDelta,
        WorkerInfo,
    )
    from router.worker_client import WorkerClient

    class Prefill(WorkerClient):
        def __init__(self, worker_id: str) -> None:
            self.worker_id = worker_id

        async def info(self):
            return WorkerInfo(self.worker_id, PoolKind.PREFILL, "node", "127.0.0.1", BLOCK, 1 << 20)

        async def ping(self, timeout):
            return Heartbeat(self.worker_id, 0.0, False, True)

        async def report(self, since, timeout):
            return LoadReport(self.worker_id, EngineLoad(0, 0, 0, 1 << 20, 1 << 20, 0))

        async def prefill(self, key, prompt, params, reservation, cache_since=None, verify_kv=False):
            now, token = time.time(), 1000 + len(prompt) % 1000
            yield FirstToken(key, token, None, 0, now, now)
            yield PrefillResult(key, token, None, 0, scheduled_at=now, sampled_at=now, kv_done_at=now)

        async def reserve(self, *a, **k):
            raise NotImplementedError

        async def set_destination(self, *a, **k):  # (its info says it takes no prompt without its blocks)
            raise NotImplementedError

        async def renew(self, keys, timeout):
            return []

        async def start(self, *a, **k):
            raise NotImplementedError

        async def submit(self, *a, **k):
            raise NotImplementedError

        async def abort(self, key, timeout):
            pass

        async def release_router(self, router_id, timeout, final=True):
            return 0

        async def pause(self, key, timeout):
            pass

        async def resume(self, key, timeout):
            pass

        async def hold(self, *a, **k):  # drains: not benchmarked here
            raise NotImplementedError

        async def connect(self, *a, **k):
            raise NotImplementedError

        async def send_kv(self, *a, **k):
            raise NotImplementedError

        async def kv_digest(self, *a, **k):
            raise NotImplementedError

        async def forget_kv(self, *a, **k):
            raise NotImplementedError

        async def steps(self) -> AsyncIterator:
            raise NotImplementedError
            yield

        async def shutdown(self, timeout):
            pass

        def kill(self):
            pass

    class Decode(Prefill):
        """One token for every running sequence per step; a deterministic token stream per sequence."""

        def __init__(self, worker_id: str, step_s: float) -> None:
            super().__init__(worker_id)
            self.step_s = step_s
            self.reserved: dict[str, int] = {}
            self.running: dict[str, list[int]] = {}  # key -> [next token, tokens left]
            self.outbox: asyncio.Queue = asyncio.Queue()
            self.task: asyncio.Task | None = None

        async def info(self):
            return WorkerInfo(self.worker_id, PoolKind.DECODE, "node", "127.0.0.1", BLOCK, 1 << 20)

        async def reserve(self, key, prompt, params, src, timeout):
            self.reserved[key] = params.max_tokens
            return Reservation(None, [0], 0, 30.0)

        async def start(self, key, first_token, timeout):
            left = self.reserved.pop(key, None)
            if left is None:
                return False
            self.running[key] = [first_token, left - 1]
            if self.task is None:
                self.task = asyncio.ensure_future(self._loop())
            return True

        async def abort(self, key, timeout):
            self.reserved.pop(key, None)
            self.running.pop(key, None)

        async def _loop(self) -> None:
            load = EngineLoad(0, 0, 0, 1 << 20, 1 << 20, 0)
            while True:
                await asyncio.sleep(self.step_s)
                if not self.running:
                    continue
                deltas = []
                for key, st in list(self.running.items()):
                    st[0] = 1000 + (st[0] * 7 + 3) % 20000
                    st[1] -= 1
                    done = st[1] <= 0
                    deltas.append(TokenDelta(key, [st[0]], FinishReason.LENGTH if done else None))
                    if done:
                        del self.running[key]
                self.outbox.put_nowait(StepOutput(1, time.time(), deltas, load))

        async def steps(self) -> AsyncIterator:
            while True:
                yield await self.outbox.get()

    return Prefill, Decode


def _router_process(port_q: mp.Queue, stop_ev, step_s: float, profile: str | None = None, port: int = 0) -> None:
    """The process under test: router + gRPC door + metrics over fake workers. `port` 0: any free port;
    another replica's port: share it (SO_REUSEPORT, gRPC's default on Linux)."""

    async def main() -> None:
        import grpc

        from engine.hub import resolve_model
        from engine.model_files import load_config
        from engine.tokenizer import Tokenizer
        from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
        from router.metrics import Metrics
        from router.registry import WorkerRegistry, make_worker
        from router.router import Router, RouterConfig
        from router.servicer import GenerationServicer
        from router.validation import Limits

        path = resolve_model("smollm2-135m")
        model = load_config(path)
        tokenizer = Tokenizer(path)
        metrics = Metrics("smollm2-135m")
        servicer = GenerationServicer("smollm2-135m", tokenizer, Limits(model.max_position_embeddings,
                                                                         model.vocab_size), BLOCK, metrics)
        registry = WorkerRegistry()
        router = Router(RouterConfig(block_size=BLOCK, max_queue=100_000), registry, metrics)
        Prefill, Decode = _fake_worker_classes()
        for client in (Prefill("prefill-0"), Decode("decode-0", step_s)):
            registry.add(make_worker(await client.info(), client))
        servicer.router = router
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        port_q.put(bound)
        while not stop_ev.is_set():
            await asyncio.sleep(0.1)
        await server.stop(None)

    if profile is None:
        asyncio.run(main())
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        asyncio.run(main())
    finally:
        prof.disable()
        prof.dump_stats(profile)


def _connections(concurrency: int, clients: int) -> int:
    """TCP connections per client process: up to 16, so the kernel spreads them over the replicas. NOTE: the
    same for one router, since a connection's count changes the cost per token (gRPC coalesces the frames of
    the streams sharing a connection into fewer writes)."""
    return min(16, max(1, concurrency // clients))


def _replica_pids() -> list[int]:
    """Router replicas running as Ray actors (Ray titles their processes `ray::RouterReplica...`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::RouterReplica"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _serve(repo: str, routers: int, port: int):
    """`pdserve serve` (1 prefill + 1 decode worker, SmolLM2) from the checkout at `repo`; returns the process
    once it answers health checks with SERVING."""
    import subprocess

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cmd = [sys.executable, "-m", "control.cli", "serve", "--model", "smollm2-135m", "--prefill-workers", "1",
           "--decode-workers", "1", "--port", str(port), "--metrics-port", str(port + 1)]
    if routers > 1:
        cmd += ["--routers", str(routers)]
    proc = subprocess.Popen(cmd, cwd=repo, env={**os.environ, "PYTHONPATH": repo},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        while True:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"pdserve serve from {repo} did not start (exit {proc.poll()})")
            time.sleep(0.5)
    while len(_replica_pids()) < routers - 1:
        time.sleep(0.2)
    return proc


def run_served(concurrency: int, tokens: int, duration_s: float, routers: int, repo: str,
               clients: int = 2, port: int = 50851) -> dict:
    """One row against a real deployment (the checkout at `repo`): router CPU is the `pdserve serve` process
    plus its router replicas, everything a router does per token included (Ray's step streams, pings,
    load reports, lease renewals)."""
    import signal

    server = _serve(repo, routers, port)
    pids = [server.pid, *_replica_pids()]
    out_q = child.CONTEXT.Queue()
    per = [concurrency // clients + (1 if i < concurrency % clients else 0) for i in range(clients)]
    connections = _connections(concurrency, clients)
    procs = [child.process(_client_process, port, n, tokens, duration_s, out_q, connections)
             for n in per if n]
    try:
        cpu0, t0 = sum(_cpu_seconds(p) for p in pids), time.monotonic()
        for p in procs:
            p.start()
        results = [out_q.get(timeout=duration_s + 600) for _ in procs]
        wall, cpu = time.monotonic() - t0, sum(_cpu_seconds(p) for p in pids) - cpu0
        for p in procs:
            p.join(30)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except Exception:  # noqa: BLE001 - a stuck shutdown must not hang the bench
            server.kill()
    return _row(results, wall, cpu, routers, concurrency, tokens, 0.0) | {"repo": repo}


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_process(port: int, streams: int, tokens: int, duration_s: float, out_q: mp.Queue,
                    connections: int = 1) -> None:
    """Keep `streams` streams open for `duration_s` over `connections` TCP connections (the kernel hands each
    to one router replica); report every request's TTFT and gaps."""

    async def main() -> None:
        import grpc

        from protos.pdserve.v1 import generation_pb2 as pb
        from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc

        ttfts, itls, done = [], [], 0
        deadline = time.monotonic() + duration_s
        # NOTE: gRPC shares one connection between channels to one address unless each has its own pool
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(connections)]
        stubs = [pb_grpc.GenerationStub(ch) for ch in channels]

        async def one_client(c: int) -> None:
            nonlocal done
            stub = stubs[c % len(stubs)]
            n = 0
            while time.monotonic() < deadline:
                req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[100 + c, 200 + n % 50, 300]),
                                         sampling=pb.SamplingParams(max_tokens=tokens, temperature=0,
                                                                    ignore_eos=True))
                n += 1
                t0 = last = time.perf_counter()
                first = True
                async for r in stub.Generate(req, timeout=120):
                    now = time.perf_counter()
                    k = len(r.token_ids)
                    if k:  # a message of k tokens: one gap, then k - 1 that arrived together
                        if first:
                            ttfts.append(now - t0)
                            itls.extend([0.0] * (k - 1))
                            first = False
                        else:
                            itls.extend([now - last] + [0.0] * (k - 1))
                        last = now
                done += 1

        await asyncio.gather(*(one_client(c) for c in range(streams)))
        for ch in channels:
            await ch.close()
        out_q.put((ttfts, itls, done))

    asyncio.run(main())


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(concurrency: int, tokens: int, step_s: float, duration_s: float, clients: int = 2,
        profile: str | None = None, routers: int = 1) -> dict:
    """One row: `routers` router processes sharing one port (each over its own fake workers: this measures
    relaying, the e2e tests prove the shared pools), `clients` client processes."""
    ctx = child.CONTEXT
    port_q, out_q, stop_ev = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs_r, port = [], 0
    for i in range(routers):
        r = child.process(_router_process, port_q, stop_ev, step_s, profile if i == 0 else None, port)
        r.start()
        port = port_q.get(timeout=120)
        procs_r.append(r)
    per = [concurrency // clients + (1 if i < concurrency % clients else 0) for i in range(clients)]
    connections = _connections(concurrency, clients)
    procs = [child.process(_client_process, port, n, tokens, duration_s, out_q, connections)
             for n in per if n]
    cpu0, t0 = sum(_cpu_seconds(r.pid) for r in procs_r), time.monotonic()
    for p in procs:
        p.start()
    results = [out_q.get(timeout=duration_s + 300) for _ in procs]
    wall, cpu = time.monotonic() - t0, sum(_cpu_seconds(r.pid) for r in procs_r) - cpu0
    for p in procs:
        p.join(30)
    stop_ev.set()
    for r in procs_r:
        r.join(30)
    return _row(results, wall, cpu, routers, concurrency, tokens, step_s)


def _row(results, wall: float, cpu: float, routers: int, concurrency: int, tokens: int, step_s: float) -> dict:
    ttfts = [x for r in results for x in r[0]]
    itls = [x for r in results for x in r[1]]
    relayed = len(ttfts) + len(itls)
    return {"routers": routers, "concurrency": concurrency, "tokens_per_request": tokens, "step_ms": step_s * 1e3,
            "requests": sum(r[2] for r in results), "relayed_tokens": relayed, "wall_s": wall,
            "tokens_per_s": relayed / wall, "router_cpu_s": cpu,
            "router_cpu_ms_per_token": cpu / relayed * 1e3 if relayed else float("nan"),
            "router_cores": cpu / wall,
            "ttft_ms": {q: _pct(ttfts, p) * 1e3 for q, p in (("p50", 0.5), ("p99", 0.99))},
            "itl_ms": {q: _pct(itls, p) * 1e3 for q, p in (("p50", 0.5), ("p99", 0.99))},
            "itl_added_ms_p50": (statistics.median(itls) - step_s) * 1e3 if itls else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--tokens", type=int, default=200, help="tokens per request")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake decode worker's step time")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of load per concurrency")
    ap.add_argument("--routers", type=int, nargs="+", default=[1],
                    help="router replicas sharing the port; several values run side by side, interleaved "
                         "ABBA per concurrency (e.g. --routers 1 2)")
    ap.add_argument("--serve", nargs="*", metavar="REPO", default=None,
                    help="drive a real `pdserve serve` (SmolLM2, 1 prefill + 1 decode worker) started from each "
                         "checkout REPO (default: this one) instead of fake workers, e.g. an older commit's "
                         "worktree to compare against; rows interleave the checkouts and --routers ABBA")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, metavar="FILE", help="also write the rows here (JSON)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="cProfile the router process (the last concurrency's run) into FILE (pstats)")
    args = ap.parse_args(argv)
    rows = []
    # ABBA over the router counts: a drift of the shared machine during the run falls on both alike
    order = args.routers if len(args.routers) == 1 else args.routers + args.routers[::-1]
    if args.serve is not None:
        repos = args.serve or [os.getcwd()]
        layouts = [(repo, n) for repo in repos for n in args.routers]
        order = layouts if len(layouts) == 1 else layouts + layouts[::-1]
    for c in args.concurrency:
        for n in order:
            if args.serve is not None:
                (repo, n) = n
                print(f"concurrency {c}, {n} router(s), pdserve serve from {repo}: {args.duration:.0f}s of load...",
                      file=sys.stderr, flush=True)
                rows.append(run_served(c, args.tokens, args.duration, n, repo))
            else:
                print(f"concurrency {c}, {n} router(s): {args.duration:.0f}s of load...", file=sys.stderr,
                      flush=True)
                last = c == args.concurrency[-1]
                rows.append(run(c, args.tokens, args.step_ms / 1e3, args.duration,
                                profile=args.profile if last else None, routers=n))
            r = rows[-1]
            print(f"  {r['tokens_per_s']:.0f} tokens/s, routers {r['router_cpu_ms_per_token']:.3f} CPU-ms/token "
                  f"({r['router_cores']:.2f} cores), TTFT p50 {r['ttft_ms']['p50']:.1f} ms, ITL p50 "
                  f"{r['itl_ms']['p50']:.1f} ms (+{r['itl_added_ms_p50']:.1f})", file=sys.stderr, flush=True)
    emit({"rows": rows}, args.out, args.json, _table)
    return 0


def _table(summary: dict) -> str:
    lines = ["| routers | streams | tokens/s | router CPU ms/token | router cores | TTFT p50/p99 ms | ITL p50/p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['routers']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
                     f"{r['router_cpu_ms_per_token']:.3f} | {r['router_cores']:.2f} | {r['ttft_ms']['p50']:.1f} / "
                     f"{r['ttft_ms']['p99']:.1f} | {r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
