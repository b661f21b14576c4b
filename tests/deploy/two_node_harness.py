"""A real two-node Ray cluster on this machine, pdserve joined to it, and a node leaving and joining.

Run as a module in its own process (`python -m tests.deploy.two_node_harness`): it makes its own Ray cluster,
which must not collide with the test session's. Prints one JSON line of observations for the test to check.
Both nodes live on 127.0.0.1 (two raylets, distinct node ids and custom resources), so nothing leaves
loopback while the pools, the KV transfer and the failure handling behave as across two machines.
"""

from __future__ import annotations

import json
import os
import threading

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every node on loopback (see pin_ray_to_loopback)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import grpc  # noqa: E402
import ray  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from control.config import ServeConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from protos.pdserve.v1 import generation_pb2 as pb  # noqa: E402
from tests.cluster import wait_for  # noqa: E402
from tests.serving.conftest import RunningServer, greedy_request, token_ids  # noqa: E402

PROMPTS = ["two nodes", "KV crosses the network"]


def node_args(resource: str) -> dict:
    # every node also offers one `decode_slot`, so a pool asking for it puts one worker on each node
    return {"num_cpus": 3, "resources": {resource: 2, "decode_slot": 1}, "node_ip_address": "127.0.0.1",
            "include_dashboard": False}


def pools(server: RunningServer) -> dict[str, str]:
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    return {w.worker_id: w.node_id for p in info.pools for w in p.workers}


def main() -> None:
    out: dict = {}
    cluster = Cluster(initialize_head=True, head_node_args=node_args("prefill_node"))
    decode_node = cluster.add_node(**node_args("decode_node"))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    out["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
    llm = LLM("tiny-random", num_blocks=64)
    reference = [o.token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    long_reference = llm.generate(["interrupted"], SamplingParams(max_tokens=400, temperature=0,
                                                                   ignore_eos=True))[0].token_ids
    del llm

    # locality: one decode worker per node; decode should follow the prefill worker onto the head node
    server = RunningServer(ServeConfig(
        model="tiny-random", ray_address=cluster.address, port=0, metrics_port=0, worker_threads=1,
        num_blocks=64, decode_workers=2, prefill_resources={"CPU": 1, "prefill_node": 1},
        decode_resources={"CPU": 1, "decode_slot": 1}))
    try:
        out["locality_nodes"] = pools(server)
        out["locality_served_by"] = [server.generate(greedy_request(p, 4))[-1].decode_worker_id
                                     for p in PROMPTS * 2]
    finally:
        server.close()

    server = RunningServer(ServeConfig(
        model="tiny-random", ray_address=cluster.address, port=0, metrics_port=0, worker_threads=1,
        num_blocks=64, prefill_resources={"CPU": 1, "prefill_node": 1},
        decode_resources={"CPU": 1, "decode_node": 1}, admission_timeout_s=120.0))
    try:
        out["nodes_before"] = pools(server)
        out["head_node"] = ray.get_runtime_context().get_node_id()
        out["decode_node"] = decode_node.node_id
        lasts = []
        for prompt, want in zip(PROMPTS, reference):
            res = server.generate(greedy_request(prompt, 12, ignore_eos=True))
            lasts.append(res[-1])
            out.setdefault("equal", []).append(token_ids(res) == want)
        out["kv_transfer_seconds"] = [r.timing.kv_transfer_seconds for r in lasts]
        out["served_by"] = [(r.prefill_worker_id, r.decode_worker_id) for r in lasts]
        registry = server.server.observer.registry
        out["kv_bytes"] = registry.get_sample_value(
            "pdserve_kv_transfer_bytes_total", {"model": "tiny-random", "src": "prefill-0", "dst": "decode-0"})

        # the decode node leaves mid-stream: the pool shrinks, health says NOT_SERVING, and the stream
        # waits for a decode worker to continue on
        stream = server.stub.Generate(greedy_request("interrupted", 400, ignore_eos=True), timeout=180)
        got = list(next(stream).token_ids)
        cluster.remove_node(decode_node)
        mid: dict = {}

        def consume() -> None:
            try:
                for r in stream:
                    got.extend(r.token_ids)
                mid["status"] = "completed"
            except grpc.RpcError as e:
                mid["status"] = f"{e.code().name}: {e.details()}"

        consumer = threading.Thread(target=consume)
        consumer.start()
        wait_for(lambda: "decode-0" not in pools(server), 30, "the lost decode worker to leave the pool")
        health = health_pb2_grpc.HealthStub(server.channel)
        status = wait_for(lambda: (s := health.Check(health_pb2.HealthCheckRequest(service="")).status)
                          == health_pb2.HealthCheckResponse.NOT_SERVING and s, 10, "health NOT_SERVING")
        out["health_while_gone"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        out["stream_waiting_while_gone"] = consumer.is_alive()

        # a node with the decode resource joins: the pool grows back to its target, the stream goes on
        new_node = cluster.add_node(**node_args("decode_node"))
        after = wait_for(lambda: (p := pools(server)) and any(k.startswith("decode") for k in p) and p, 90,
                         "a replacement decode worker")
        out["nodes_after"] = after
        out["new_decode_node"] = new_node.node_id
        consumer.join(150)
        out["mid_stream"] = mid.get("status", "still running")
        out["mid_stream_equal"] = got == long_reference
        out["health_after"] = health_pb2.HealthCheckResponse.ServingStatus.Name(wait_for(
            lambda: (s := health.Check(health_pb2.HealthCheckRequest(service="")).status)
            == health_pb2.HealthCheckResponse.SERVING and s, 10, "health SERVING"))
        res = server.generate(greedy_request(PROMPTS[0], 12, ignore_eos=True))
        out["after_equal"] = token_ids(res) == reference[0]
        out["after_served_by"] = [res[-1].prefill_worker_id, res[-1].decode_worker_id]
    finally:
        server.close()
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
