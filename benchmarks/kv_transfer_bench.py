"""KV transfer speed: a SmolLM2-135M request's KV shipped block-wise and layer-wise between two processes.

Compared against a raw gloo send/recv of one contiguous tensor of the same bytes between the same two
processes (the ceiling for the transport), and against the Ray object-store fallback between two Ray actors.
Each transfer gathers scattered source blocks and scatters into scattered destination blocks, as in
serving; "block-wise" numbers include that packing. All layers are offered at once (no compute), so the
numbers are transport throughput; `--compute-ms` adds a simulated per-layer compute to show how much of the
transfer is left after the last layer (the overlap layer-wise push buys).

Also timed side by side: the bare copy pipeline (the same gather, send, receive and scatter, a few layers
per message, with receives posted ahead and no protocol at all): what any design that packs scattered
blocks costs on this machine, so `blockwise_vs_copy_pipeline` is what the transport's protocol costs (or
saves: its poster overlaps the copies a little better).

Time is CLOCK_MONOTONIC, shared by processes on one node: start = the sender's clock before `begin`
(or the raw send), end = the receiver's clock when the last layer has landed.

    python -m benchmarks.kv_transfer_bench --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch

# NOTE: until the editable install is refreshed (it predates kv_transfer/), make the repo importable.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from engine.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from kv_transfer import (  # noqa: E402
    KVReceiver,
    KVSender,
    KVTransferConfig,
    RendezvousServer,
    create_receiver,
    create_sender,
)
from kv_transfer.layout import as_bytes, pack_layers, scatter_layers  # noqa: E402
from protocol.messages import PeerAddress  # noqa: E402

HOST = "127.0.0.1"  # both processes on this node
_PIPE_DEPTH = 4  # messages in flight in the copy-pipeline baseline (the transport's window and slots)
_PIPE_MESSAGE_BYTES = 4 << 20  # its message size: the transport's receive slot
# SmolLM2-135M: 30 layers, 3 KV heads of 64, 16-token blocks, fp32
SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)


def _layer_shape(nblocks: int) -> tuple[int, ...]:
    return (2, nblocks, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)


def _pipe_layers(nblocks: int) -> int:
    """Layers per copy-pipeline message: as many as fit the transport's message size (at least one)."""
    return max(1, _PIPE_MESSAGE_BYTES // (nblocks * SPEC.bytes_per_block // SPEC.num_layers))


def log(msg: str) -> None:
    print(f"[kv-bench] {msg}", file=sys.stderr, flush=True)


class BenchPeer:
    """One side of the benchmark, in its own process (spawned) or a Ray actor."""

    def __init__(self, role: str, config: KVTransferConfig, num_blocks: int, device: str = "cpu") -> None:
        torch.set_num_threads(1)
        self.role = role
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.cache = KVCache(SPEC, num_blocks, device)
        raw = self.cache.tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=self.device))
        make = create_sender if role == "sender" else create_receiver
        self.transport: KVSender | KVReceiver = make(config, f"bench-{role}-{os.getpid()}", self.cache, HOST)
        self.raw: Any = None
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.done: dict[str, tuple[float, bool, str | None]] = {}
        self.events: dict[str, threading.Event] = {}

    def cpu(self) -> float:
        """CPU seconds this process has used, all threads (the fair measure on a shared machine)."""
        return time.process_time()

    def endpoint(self) -> Any:
        t = self.transport
        return t.address if isinstance(t, KVReceiver) else t.endpoint_id

    # ---- raw baseline: one contiguous tensor over the transport's own backend ----

    def raw_connect(self, port: int, max_bytes: int, nccl: bool) -> None:
        """gloo between CPU buffers; NCCL between the two GPUs' memory when the transport uses NCCL."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        store = PrefixStore("bench/raw", TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60)))
        rank = 0 if self.role == "sender" else 1
        if nccl:
            from torch.distributed import ProcessGroupNCCL

            self.raw = ProcessGroupNCCL(store, rank, 2, ProcessGroupNCCL.Options())
            self.buf = torch.ones(max_bytes, dtype=torch.uint8, device=self.device)
            return
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=60)
        opts._devices = [ProcessGroupGloo.create_device(hostname=HOST)]
        self.raw = ProcessGroupGloo(store, rank, 2, opts)
        self.buf = torch.ones(max_bytes, dtype=torch.uint8)  # touched: no page faults inside the timing

    def raw_send(self, nbytes: int) -> float:
        t0 = time.monotonic()
        self.raw.send([self.buf[:nbytes]], 1, 0).wait()
        self._sync()
        return t0

    def raw_recv_start(self, tag: str, nbytes: int) -> None:
        def recv() -> tuple[bool, str | None]:
            self.raw.recv([self.buf[:nbytes]], 0, 0).wait()
            self._sync()
            return True, None

        self._watch(tag, recv)

    def _sync(self) -> None:
        """NCCL's `wait` only orders the current stream: finished means finished on the GPU too."""
        if self.buf.is_cuda:
            torch.cuda.synchronize(self.buf.device)

    # ---- the copy pipeline alone: the same gather -> send -> receive -> scatter, no protocol ----

    def pipe_send(self, src_ids: list[int]) -> float:
        """Gather the blocks of a few layers at a time (up to the transport's message size) into a ring
        buffer and send it on the raw group while the next ones are gathered (a poster thread sends, as
        the transport's link does); no headers, no protocol."""
        src, window = torch.tensor(src_ids), threading.Semaphore(_PIPE_DEPTH)
        per = _pipe_layers(len(src_ids))
        ring = [torch.empty((per, *_layer_shape(len(src_ids))), dtype=SPEC.dtype) for _ in range(_PIPE_DEPTH + 1)]
        out: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()

        def post() -> None:
            while (buf := out.get()) is not None:
                self.raw.send([as_bytes(buf)], 1, 1).wait()
                window.release()

        poster = threading.Thread(target=post)
        t0 = time.monotonic()
        poster.start()
        for i, first in enumerate(range(0, SPEC.num_layers, per)):
            window.acquire()
            count = min(per, SPEC.num_layers - first)
            buf = ring[i % len(ring)][:count]
            pack_layers(self.cache.tensor, first, count, src, out=buf)
            out.put(buf)
        out.put(None)
        poster.join()
        return t0

    def pipe_recv_start(self, tag: str, dst_ids: list[int]) -> None:
        """Keep receives posted ahead (as the transport's link does); scatter each message as it lands."""
        dst, per = torch.tensor(dst_ids), _pipe_layers(len(dst_ids))
        firsts = list(range(0, SPEC.num_layers, per))

        def post(first: int, slot: torch.Tensor) -> tuple[Any, torch.Tensor, int]:
            view = slot[:min(per, SPEC.num_layers - first)]
            return self.raw.recv([as_bytes(view)], 0, 1), view, first

        def recv() -> tuple[bool, str | None]:
            slots = [torch.empty((per, *_layer_shape(len(dst_ids))), dtype=SPEC.dtype) for _ in range(_PIPE_DEPTH)]
            posted = [post(first, slot) for first, slot in zip(firsts, slots, strict=False)]
            for i in range(len(firsts)):
                work, view, first = posted.pop(0)
                work.wait()
                scatter_layers(self.cache.tensor, first, dst, view)
                if i + _PIPE_DEPTH < len(firsts):
                    posted.append(post(firsts[i + _PIPE_DEPTH], slots[i % _PIPE_DEPTH]))
            return True, None

        self._watch(tag, recv)

    # ---- the transport ----

    def expect(self, rid: str, src: str, dst_ids: list[int]) -> None:
        assert isinstance(self.transport, KVReceiver)
        self.transport.expect(rid, src, dst_ids, time.monotonic() + 120)

        def wait() -> tuple[bool, str | None]:
            r = self.transport.wait(rid, 120)
            return r.ok, r.error

        self._watch(rid, wait)

    def push(self, rid: str, dst: PeerAddress, src_ids: list[int], dst_ids: list[int],
             compute_s: float) -> tuple[float, float]:
        """Begin and offer every layer (after `compute_s` of simulated compute each): (start, last offer)."""
        assert isinstance(self.transport, KVSender)
        t0 = time.monotonic()
        self.transport.begin(rid, dst, src_ids, dst_ids, t0 + 120)
        for layer in range(SPEC.num_layers):
            if compute_s:
                time.sleep(compute_s)
            self.transport.send_layer(rid, layer)
        t_last = time.monotonic()
        r = self.transport.wait(rid, 120)
        assert r.ok, r.error
        return t0, t_last

    def result(self, tag: str) -> float:
        assert self.events[tag].wait(120), f"{tag} unfinished"
        t1, ok, err = self.done.pop(tag)
        assert ok, err
        return t1

    def close(self) -> None:
        self.transport.close()

    def _watch(self, tag: str, fn: Any) -> None:
        self.events[tag] = threading.Event()

        def run() -> None:
            try:
                ok, err = fn()
            except Exception as e:  # reported by result()
                ok, err = False, f"{type(e).__name__}: {e}"
            self.done[tag] = (time.monotonic(), ok, err)
            self.events[tag].set()

        threading.Thread(target=run, daemon=True).start()


def _serve(conn: Any, role: str, config: KVTransferConfig, num_blocks: int, device: str) -> None:
    peer = BenchPeer(role, config, num_blocks, device)
    conn.send((True, None))
    while True:
        method, args = conn.recv()
        try:
            conn.send((True, getattr(peer, method)(*args)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))
        if method == "close":
            return


class ProcPeer:
    def __init__(self, role: str, config: KVTransferConfig, num_blocks: int, device: str = "cpu") -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(child, role, config, num_blocks, device),
                                                    daemon=True)
        self.proc.start()
        self._get()

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._get()

    def _get(self) -> Any:
        assert self.conn.poll(180), "peer unresponsive"
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value


class RayActorPeer:
    def __init__(self, role: str, config: KVTransferConfig, num_blocks: int) -> None:
        import ray

        env = {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}
        self.actor = ray.remote(BenchPeer).options(num_cpus=0, max_concurrency=4, runtime_env={"env_vars": env}) \
            .remote(role, config, num_blocks)

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=180)


def scattered(n: int, num_blocks: int, seed: int) -> list[int]:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


CPU: list[float] = []  # CPU seconds (both processes) of each transfer timed last


def cpu_of(tx: Any, rx: Any) -> float:
    return tx.call("cpu") + rx.call("cpu")


def time_transfers(tx: Any, rx: Any, nblocks: int, num_blocks: int, reps: int, tag: str,
                   compute_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Seconds per transfer (start to last layer landed) and seconds left after the last layer's offer."""
    src_name, dst = tx.call("endpoint"), rx.call("endpoint")
    total, tails = [], []
    CPU.clear()
    for i in range(reps):
        rid = f"{tag}-{nblocks}-{i}"
        src_ids, dst_ids = scattered(nblocks, num_blocks, i), scattered(nblocks, num_blocks, 1000 + i)
        c0 = cpu_of(tx, rx)
        rx.call("expect", rid, src_name, dst_ids)
        t0, t_last = tx.call("push", rid, dst, src_ids, dst_ids, compute_s)
        t1 = rx.call("result", rid)
        CPU.append(cpu_of(tx, rx) - c0)
        total.append(t1 - t0)
        tails.append(t1 - t_last)
    return total, tails


def time_raw(tx: Any, rx: Any, nbytes: int, reps: int) -> list[float]:
    out = []
    CPU.clear()
    for i in range(reps):
        tag = f"raw-{nbytes}-{i}"
        c0 = cpu_of(tx, rx)
        rx.call("raw_recv_start", tag, nbytes)
        t0 = tx.call("raw_send", nbytes)
        out.append(rx.call("result", tag) - t0)
        CPU.append(cpu_of(tx, rx) - c0)
    return out


def time_pipe(tx: Any, rx: Any, nblocks: int, num_blocks: int, seed: int) -> float:
    """One transfer through the bare copy pipeline, with the same scattered ids as `time_transfers`."""
    src_ids, dst_ids = scattered(nblocks, num_blocks, seed), scattered(nblocks, num_blocks, 1000 + seed)
    tag = f"pipe-{nblocks}-{seed}"
    rx.call("pipe_recv_start", tag, dst_ids)
    t0 = tx.call("pipe_send", src_ids)
    return rx.call("result", tag) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="request lengths")
    ap.add_argument("--reps", type=int, default=15, help="timed transfers per size (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compute-ms", type=float, default=2.0, help="simulated compute per layer for the overlap run")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray object-store path")
    ap.add_argument("--devices", nargs=2, default=["cpu", "cpu"], metavar=("SENDER", "RECEIVER"),
                    help="where the two caches live, e.g. cuda:0 cuda:1 (NCCL between them, and for the raw "
                         "baseline; the bare copy pipeline and the Ray path run on CPU caches only)")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args()
    for dev in args.devices:
        if dev != "cpu" and not (dev.startswith("cuda") and torch.cuda.is_available()
                                 and torch.device(dev).index in (None, *range(torch.cuda.device_count()))):
            ap.error(f"--devices: {dev!r} is not a device here (cpu, or cuda:N with "
                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} GPUs)")

    max_blocks = max(-(-t // SPEC.block_size) for t in args.tokens)
    num_blocks = 2 * max_blocks + 8
    bytes_per_block = SPEC.bytes_per_block
    server = RendezvousServer(HOST)
    raw_server = RendezvousServer(HOST)
    cfg = KVTransferConfig(rendezvous_host=HOST, rendezvous_port=server.port, op_timeout_s=30.0)
    tx_dev, rx_dev = args.devices
    on_cpu = tx_dev == rx_dev == "cpu"
    nccl = tx_dev.startswith("cuda") and rx_dev.startswith("cuda") and tx_dev != rx_dev
    log(f"spawning sender ({tx_dev}) and receiver ({rx_dev}) processes ({num_blocks} blocks of "
        f"{bytes_per_block / 2**20:.2f} MiB; transport and raw baseline over {'NCCL' if nccl else 'gloo'})")
    tx, rx = ProcPeer("sender", cfg, num_blocks, tx_dev), ProcPeer("receiver", cfg, num_blocks, rx_dev)
    threads = [threading.Thread(target=p.call, args=("raw_connect", raw_server.port, max_blocks * bytes_per_block,
                                                     nccl))
               for p in (tx, rx)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    sizes: dict[str, dict[str, float]] = {}
    for tokens in args.tokens:
        n = -(-tokens // SPEC.block_size)
        nbytes = n * bytes_per_block
        time_raw(tx, rx, nbytes, args.warmup)
        time_transfers(tx, rx, n, num_blocks, args.warmup, "warm")
        if on_cpu:
            time_pipe(tx, rx, n, num_blocks, 0)
        raws, blockwises, pipes, raw_cpu, bw_cpu = [], [], [], [], []
        for i in range(args.reps):  # NOTE: alternating, so all three see the same load on a shared machine
            raws += time_raw(tx, rx, nbytes, 1)
            raw_cpu += CPU
            blockwises += time_transfers(tx, rx, n, num_blocks, 1, f"bw{i}")[0]
            bw_cpu += CPU
            if on_cpu:
                pipes.append(time_pipe(tx, rx, n, num_blocks, i))
        raw, blockwise = statistics.median(raws), statistics.median(blockwises)
        sizes[str(tokens)] = dict(tokens=tokens, blocks=n, bytes=nbytes, raw_ms=1e3 * raw,
                                  blockwise_ms=1e3 * blockwise, raw_gbps=nbytes / raw / 1e9,
                                  blockwise_gbps=nbytes / blockwise / 1e9, blockwise_vs_raw=raw / blockwise,
                                  best_raw_ms=1e3 * min(raws), best_blockwise_ms=1e3 * min(blockwises),
                                  raw_cpu_ms=1e3 * statistics.median(raw_cpu),
                                  blockwise_cpu_ms=1e3 * statistics.median(bw_cpu))
        line = (f"{tokens:5d} tokens, {nbytes / 1e6:6.1f} MB: raw {1e3 * raw:7.2f} ms ({nbytes / raw / 1e9:.2f} "
                f"GB/s, {1e3 * statistics.median(raw_cpu):.1f} ms CPU), block-wise layer-wise "
                f"{1e3 * blockwise:7.2f} ms ({nbytes / blockwise / 1e9:.2f} GB/s, "
                f"{1e3 * statistics.median(bw_cpu):.1f} ms CPU), ratio {raw / blockwise:.2f} (best runs: "
                f"{min(raws) / min(blockwises):.2f})")
        if pipes:
            pipe = statistics.median(pipes)
            sizes[str(tokens)].update(copy_pipeline_ms=1e3 * pipe, copy_pipeline_vs_raw=raw / pipe,
                                      blockwise_vs_copy_pipeline=pipe / blockwise)
            line += f"; bare copy pipeline {1e3 * pipe:.2f} ms, {raw / pipe:.2f} of raw"
        log(line)

    # per-transfer overhead: one block (30 layer messages of one block each) against raw of the same bytes
    raws, smalls = [], []
    for i in range(args.reps):
        raws += time_raw(tx, rx, bytes_per_block, 1)
        smalls += time_transfers(tx, rx, 1, num_blocks, 1, f"small{i}")[0]
    raw_small, bw_small = statistics.median(raws), statistics.median(smalls)
    log(f"one-block transfer: block-wise {1e3 * bw_small:.2f} ms, raw {1e3 * raw_small:.2f} ms")

    # overlap: with compute between layers, what is left once the last layer is offered
    longest = max(args.tokens)
    n_long = -(-longest // SPEC.block_size)
    totals, tails = time_transfers(tx, rx, n_long, num_blocks, max(3, args.reps // 2), "overlap",
                                   args.compute_ms / 1e3)
    overlap = dict(tokens=longest, compute_ms_per_layer=args.compute_ms, total_ms=1e3 * statistics.median(totals),
                   tail_after_last_layer_ms=1e3 * statistics.median(tails),
                   transfer_alone_ms=sizes[str(longest)]["blockwise_ms"])
    log(f"overlap at {longest} tokens with {args.compute_ms} ms/layer compute: "
        f"{overlap['tail_after_last_layer_ms']:.2f} ms left after the last layer "
        f"(the transfer alone takes {overlap['transfer_alone_ms']:.2f} ms)")
    for p in (tx, rx):
        p.call("close")

    ray_sizes: dict[str, dict[str, float]] = {}
    ray_small = None
    if not args.no_ray and not on_cpu:
        log("skipping the Ray object-store path: it runs between CPU caches only")
    elif not args.no_ray:
        log("starting Ray and two actors for the object-store path")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        ray.init(_node_ip_address=HOST, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
        rcfg = KVTransferConfig(kv_transport="ray", op_timeout_s=30.0)
        rtx, rrx = RayActorPeer("sender", rcfg, num_blocks), RayActorPeer("receiver", rcfg, num_blocks)
        for tokens in args.tokens:
            n = -(-tokens // SPEC.block_size)
            nbytes = n * bytes_per_block
            time_transfers(rtx, rrx, n, num_blocks, args.warmup, "rwarm")
            t = statistics.median(time_transfers(rtx, rrx, n, num_blocks, args.reps, "ray")[0])
            ray_sizes[str(tokens)] = dict(ray_ms=1e3 * t, ray_gbps=nbytes / t / 1e9,
                                          ray_vs_raw=sizes[str(tokens)]["raw_ms"] / (1e3 * t))
            log(f"{tokens:5d} tokens: ray object store {1e3 * t:7.2f} ms ({nbytes / t / 1e9:.2f} GB/s), "
                f"vs raw gloo {ray_sizes[str(tokens)]['ray_vs_raw']:.2f}")
        ray_small = statistics.median(time_transfers(rtx, rrx, 1, num_blocks, args.reps, "rsmall")[0])
        log(f"one-block transfer over ray: {1e3 * ray_small:.2f} ms")
        for p in (rtx, rrx):
            p.call("close")
        ray.shutdown()

    for k, v in ray_sizes.items():
        sizes[k].update(v)
    report = {
        "model": "SmolLM2-135M", "num_layers": SPEC.num_layers, "num_kv_heads": SPEC.num_kv_heads,
        "head_dim": SPEC.head_dim, "block_size": SPEC.block_size, "dtype": "float32", "reps": args.reps,
        "devices": args.devices, "backend": "nccl" if nccl else "gloo",
        "blockwise_vs_raw": min(s["blockwise_vs_raw"] for s in sizes.values()),
        # the same gather -> send -> receive -> scatter copies with no protocol (CPU caches only): what any
        # design that packs scattered blocks pays on this machine, and how the transport compares with it
        "copy_pipeline_vs_raw": min((s["copy_pipeline_vs_raw"] for s in sizes.values()
                                     if "copy_pipeline_vs_raw" in s), default=None),
        "blockwise_vs_copy_pipeline": min((s["blockwise_vs_copy_pipeline"] for s in sizes.values()
                                           if "blockwise_vs_copy_pipeline" in s), default=None),
        "ray_vs_raw": min((s["ray_vs_raw"] for s in sizes.values() if "ray_vs_raw" in s), default=None),
        "gbps": {kind: {k: s.get(f"{kind}_gbps") for k, s in sizes.items()} for kind in ("raw", "blockwise", "ray")},
        "per_transfer_overhead_ms": {
            "blockwise": 1e3 * (bw_small - raw_small),
            "ray": None if ray_small is None else 1e3 * (ray_small - raw_small),
            "one_block_raw_ms": 1e3 * raw_small,
        },
        "overlap": overlap,
        "sizes": sizes,
    }
    if args.json:
        print(json.dumps(report, indent=None))
    else:
        print(json.dumps(report, indent=2))
    server.close()
    raw_server.close()


if __name__ == "__main__":
    main()
