"""pdserve on a Ray cluster whose nodes live in network namespaces (`tests.cluster`): real addresses, KV
over a veth link, the decode nodes' links throttled and cut.

Run inside the head node's namespace (`ip netns exec pdc-head python -m tests.deploy.netns_harness
[PHASE ...]`), with the cluster up; prints one `RESULT {json}` line of observations for
`test_netns_cluster.py` to check. It always observes the addresses and greedy output through the nodes,
with the KV crossing the decode node's link; then the phases named (both without arguments), in this
order: `throttle` (a 1,300-token prompt unthrottled, then with both decode links held to 100 Mbit/s) and
`cut` (the serving decode node's link cut mid-stream, restored after 12 s, the pool growing back).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time

import grpc

from control.config import ServeConfig
from control.ray_cluster import init_ray
from engine import LLM, SamplingParams
from tests.cluster import NetnsCluster, wait_for
from tests.serving.conftest import RunningServer, greedy_request, token_ids

WORKER_TIMEOUT = 4.0
SHORT = ["The capital of France is", "Across two namespaces, the KV cache"]
PHASES = ("throttle", "cut")  # run after the addresses and the short greedy requests, which always run


def kv_totals(server: RunningServer) -> dict[str, tuple[float, float]]:
    """(bytes, seconds) of KV transfers so far, per decode worker."""
    out: dict[str, list[float]] = {}
    for fam in server.server.metrics.registry.collect():
        for s in fam.samples:
            if s.name == "pdserve_kv_transfer_bytes_total":
                out.setdefault(s.labels["dst"], [0.0, 0.0])[0] += s.value
            elif s.name == "pdserve_kv_transfer_seconds_sum":
                out.setdefault(s.labels["dst"], [0.0, 0.0])[1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def metric(server: RunningServer, name: str, **labels) -> float:
    return sum(s.value for fam in server.server.metrics.registry.collect() for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def main(phases: tuple[str, ...] = PHASES) -> None:
    if unknown := set(phases) - set(PHASES):
        raise SystemExit(f"netns_harness: unknown phases {sorted(unknown)}; the phases are {', '.join(PHASES)}")
    out: dict = {"phases": list(phases)}
    cluster = NetnsCluster()
    rng = random.Random(11)
    long_a = [rng.randrange(100, 40000) for _ in range(1300)]  # 60 MB of KV: 5 s at 100 Mbit/s
    long_b = [rng.randrange(100, 40000) for _ in range(1300)]
    stream_prompt = [rng.randrange(100, 40000) for _ in range(64)]
    llm = LLM("smollm2-135m", num_blocks=400, max_num_batched_tokens=2048)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    ref_short = [o.token_ids for o in llm.generate(SHORT, greedy(12))]
    if "throttle" in phases:
        ref_long = [o.token_ids for o in llm.generate([long_a, long_b], greedy(8))]
    if "cut" in phases:
        ref_stream = llm.generate(stream_prompt, greedy(160))[0].token_ids
    del llm

    init_ray(cluster.address, 3)
    import ray

    out["ray_node_ips"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    server = RunningServer(ServeConfig(
        model="smollm2-135m", ray_address=cluster.address, port=0, metrics_port=0, worker_threads=1,
        num_blocks=256, decode_workers=2, prefill_resources={"CPU": 1, "prefill_node": 1},
        decode_resources={"CPU": 1, "decode_node": 1}, worker_timeout=WORKER_TIMEOUT))
    try:
        workers = {w.worker_id: w.info.node_ip for w in server.server.registry.live()}
        out["worker_ips"] = workers
        out["rendezvous_host"] = server.server.rendezvous_address[0] if server.server.rendezvous_address else None
        node_of = {ip: n.name for n in cluster.nodes for ip in [cluster.ip(n.name)]}

        # 1. greedy output through nodes in different namespaces; the KV crossed the decode node's link
        out["short_equal"], out["kv_crossed"] = [], []
        for prompt, want in zip(SHORT, ref_short):
            before = {n: cluster.counters(n)["rx_bytes"] for n in ("d1", "d2")}
            kv_before = kv_totals(server)
            res = server.generate(greedy_request(prompt, 12, ignore_eos=True))
            node = node_of[workers[res[-1].decode_worker_id]]
            rx = cluster.counters(node)["rx_bytes"] - before[node]
            kv = kv_totals(server)[res[-1].decode_worker_id][0] - kv_before.get(res[-1].decode_worker_id, (0, 0))[0]
            out["short_equal"].append(token_ids(res) == want)
            out["kv_crossed"].append({"node": node, "link_rx_bytes": rx, "kv_bytes": kv})

        # 2. a 1,300-token prompt, unthrottled, then with both decode links held to 100 Mbit/s
        def long_run(prompt, want) -> dict:
            kv_before = kv_totals(server)
            res = server.generate(greedy_request(prompt, 8, ignore_eos=True), timeout=300)
            dst = res[-1].decode_worker_id
            b = kv_totals(server)[dst][0] - kv_before.get(dst, (0, 0))[0]
            s = kv_totals(server)[dst][1] - kv_before.get(dst, (0, 0))[1]
            return {"equal": token_ids(res) == want, "kv_bytes": b, "kv_seconds": s,
                    "mbit_per_s": b * 8 / s / 1e6 if s else None}

        if "throttle" in phases:
            out["unthrottled"] = long_run(long_a, ref_long[0])
            for n in ("d1", "d2"):
                cluster.throttle(n, "100mbit")
            try:
                out["throttled"] = long_run(long_b, ref_long[1])
            finally:
                for n in ("d1", "d2"):
                    cluster.restore(n)

        # 3. cut the serving decode node's link mid-stream; restore it after a while
        if "cut" in phases:
            got: list[int] = []
            stream = server.stub.Generate(greedy_request(stream_prompt, 160, ignore_eos=True), timeout=300)
            first = next(stream)
            got += first.token_ids
            serving = wait_for(lambda: next((w for w, r in server.reports().items()
                                             if w.startswith("decode") and r.load.num_running), None), 30,
                               "the stream to be decoding")
            cut_node = node_of[workers[serving]]
            out["cut_node"] = cut_node
            lost_at: list[float] = []

            def watch() -> None:
                w = server.server.registry.get(serving)
                end = time.monotonic() + 60
                while w.alive and time.monotonic() < end:
                    time.sleep(0.05)
                lost_at.append(time.monotonic())

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            t_cut = time.monotonic()
            cluster.cut(cut_node)
            restorer = threading.Timer(12.0, cluster.restore, args=(cut_node,))
            restorer.start()
            last = first
            try:
                for r in stream:
                    got += r.token_ids
                    last = r
                out["cut_stream"] = "completed"
            except grpc.RpcError as e:
                out["cut_stream"] = f"{e.code().name}: {e.details()}"
            out["cut_stream_equal"] = got == ref_stream
            out["cut_resumed_on"] = last.decode_worker_id
            watcher.join(60)
            out["declared_lost_after_s"] = lost_at[0] - t_cut if not server.server.registry.get(serving).alive else None
            out["migrations_decode_lost"] = metric(server, "pdserve_request_migrations_total", cause="decode_lost")
            restorer.join()
            try:
                wait_for(lambda: len(server.server.registry.live(server.server.registry.get(serving).kind)) == 2, 150,
                         "the decode pool to grow back to 2")
                back = True
            except TimeoutError:
                back = False
            out["pool_back"] = back
            out["decode_workers_after"] = {w.worker_id: w.info.node_ip for w in server.server.registry.live()
                                           if w.kind.value == "decode"}
            if back:
                res = server.generate(greedy_request(SHORT[0], 12, ignore_eos=True))
                out["after_equal"] = token_ids(res) == ref_short[0]
        reports = server.wait_idle(30)
        out["held_after"] = {w: r.load.total_blocks - r.load.free_blocks for w, r in reports.items()}
    except Exception as e:  # noqa: BLE001 - reported with what was observed so far
        out["error"] = repr(e)
        raise
    finally:
        print("RESULT " + json.dumps(out), flush=True)
        server.close()
        ray.shutdown()


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or PHASES)
