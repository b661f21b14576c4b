"""KV transfer between real processes: spawned processes over gloo, Ray actors over gloo, Ray actors over
the Ray object store. Each peer acts as a worker would (see kvx_harness).

The data-path tests run on all three. The failure tests (killed or paused peers) run on the two transports
(mp-torch, ray-ray): Ray actors over gloo fail exactly as spawned processes over gloo do, and each extra
process costs seconds on a 2-core box; for the same reason the two Ray harnesses share one set of actors
(a peer hosts endpoints of any transport). Victims start with the others, booting while tests run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch
from kvx_harness import SENTINEL, Job, ProcessPeer, RayPeer, Spec, make_config

from kv_transfer import KVTransferConfig

# a process per side (and a local Ray cluster for the ray cases): the default suite runs it, the fast lane (`-m "not slow"`) does not
pytestmark = pytest.mark.slow

HARNESSES = ["mp-torch", "ray-torch", "ray-ray"]
SLACK_S = 0.75  # how late past its deadline a failure may be reported on a loaded 2-core box
NUM_BLOCKS = 64


FAILURE_HARNESSES = ("mp-torch", "ray-ray")
PEERS = ("a", "b", "c", "doomed-sender", "doomed-receiver")


@dataclass
class Cluster:
    """One harness: its peers, and the transport config of the endpoints its tests open."""

    name: str
    config: KVTransferConfig
    peers: dict

    def key(self, key: str) -> str:
        return f"{self.name}-{key}"  # Ray harnesses share their actors: endpoint keys must not collide

    def victim(self, name: str):
        if self.name not in FAILURE_HARNESSES:
            pytest.skip(f"{self.name} shares its transport's failure handling with mp-torch")
        return self.peers[name]


def _start(factory: type, prefix: str) -> dict:
    return {name: factory(f"{prefix}-{name}") for name in PEERS}  # all boot at once


def _stop(peers: dict) -> None:
    for peer in peers.values():
        with contextlib.suppress(Exception):  # a victim is already dead
            peer.shutdown()


@pytest.fixture(scope="module")
def ray_peers(ray_cluster):
    """Ray actors shared by the ray-torch and ray-ray harnesses (each actor costs seconds to start)."""
    peers = _start(RayPeer, "ray")
    yield peers
    _stop(peers)


@pytest.fixture(scope="module", params=HARNESSES)
def cluster(request, rendezvous):
    kind, transport = request.param.split("-")
    config = make_config(transport, rendezvous.port)
    if kind == "ray":
        yield Cluster(request.param, config, request.getfixturevalue("ray_peers"))
        return
    peers = _start(ProcessPeer, "mp")
    yield Cluster(request.param, config, peers)
    _stop(peers)


def connect(cluster: Cluster, sender, receiver, key: str, spec: Spec, rx_spec: Spec | None = None):
    """Open a receiver endpoint on `receiver` and a sender endpoint on `sender`: (dst address, src id)."""
    dst = receiver.call("open_receiver", key, rx_spec or spec, NUM_BLOCKS, cluster.config)
    return dst, sender.call("open_sender", key, spec, NUM_BLOCKS, cluster.config)


def assert_landed(sender, receiver, key: str, rid: str, ids: list[int], skip: int) -> None:
    out_rx, out_tx = receiver.call("outcome", key, rid, 30.0), sender.call("outcome", key, rid, 30.0)
    assert out_rx.ok and out_tx.ok, (out_rx.error, out_tx.error)
    sent = sender.call("sent", key, rid)  # [L, 2, n, block_size, heads, head_dim]
    got = receiver.call("blocks", key, ids)
    assert torch.equal(sent[:, :, skip:].view(torch.uint8), got[:, :, skip:].view(torch.uint8)), f"{rid} corrupted"
    assert (got[:, :, :skip].view(torch.uint8) == SENTINEL).all(), f"{rid}: a prefix-cached block was overwritten"
    receiver.call("release", key, rid)


def land_once(sender, receiver, key: str, dst, src: str) -> None:
    """One small transfer that must land: makes the link (and proves it works) before a failure test."""
    ids = receiver.call("reserve", key, "warm", 2, 0, src, 30.0)
    sender.call("push", key, [Job("warm", dst, ids)], 30.0)
    assert_landed(sender, receiver, key, "warm", ids, 0)


@contextlib.contextmanager
def paused(peer):
    """The peer's process stopped (SIGSTOP) for the block, resumed after it whatever happens."""
    pid = peer.call("pid")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


SPECS = {
    "fp32-L3-bs16": Spec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32"),
    "bf16-L5-bs4": Spec(num_layers=5, num_kv_heads=4, head_dim=16, block_size=4, dtype="bfloat16"),
    "fp16-L2-bs8": Spec(num_layers=2, num_kv_heads=1, head_dim=32, block_size=8, dtype="float16"),
    "fp8-L2-bs16": Spec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float8_e4m3fn"),
    "smollm2-L30": Spec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32"),
}


@pytest.mark.parametrize("spec_name", SPECS)
def test_blocks_arrive_bit_for_bit_in_scattered_blocks(cluster, spec_name):
    a, c, spec, key = cluster.peers["a"], cluster.peers["c"], SPECS[spec_name], cluster.key(f"bits-{spec_name}")
    dst, src = connect(cluster, a, c, key, spec)
    free = c.call("num_free", key), a.call("num_free", key)
    jobs = {"whole": (6, 0), "prefix-hit": (9, 4)}  # (blocks, of which the receiver already holds the first k)
    reserved = {}
    for rid, (n, skip) in jobs.items():
        reserved[rid] = c.call("reserve", key, rid, n, skip, src, 30.0)
        a.call("push", key, [Job(rid, dst, reserved[rid], skip)], 30.0)
    for rid, (_, skip) in jobs.items():
        ids = reserved[rid]
        assert ids != sorted(ids) or ids != list(range(ids[0], ids[0] + len(ids))), "want scattered block ids"
        assert_landed(a, c, key, rid, ids, skip)
    assert (c.call("num_free", key), a.call("num_free", key)) == free


def test_two_senders_into_one_receiver_interleave(cluster):
    a, b, c, spec = cluster.peers["a"], cluster.peers["b"], cluster.peers["c"], SPECS["bf16-L5-bs4"]
    key = cluster.key("2to1")
    dst, src_a = connect(cluster, a, c, key, spec)
    src_b = b.call("open_sender", key, spec, NUM_BLOCKS, cluster.config)
    jobs = {peer: [] for peer in (a, b)}
    for i in range(6):
        peer, src = (a, src_a) if i % 2 else (b, src_b)
        rid = f"m{i}"
        ids = c.call("reserve", key, rid, 2 + i, i % 3, src, 30.0)
        jobs[peer].append(Job(rid, dst, ids, i % 3))
    for peer, js in jobs.items():  # both "models" run at once, each interleaving its own requests
        peer.call("push", key, js, 30.0, 0.01)
    for peer, js in jobs.items():
        for job in js:
            assert_landed(peer, c, key, job.request_id, job.dst_block_ids, job.skip)


def test_one_sender_into_two_receivers_interleave(cluster):
    a, b, c, spec = cluster.peers["a"], cluster.peers["b"], cluster.peers["c"], SPECS["fp32-L3-bs16"]
    key = cluster.key("1to2")
    dst_b = b.call("open_receiver", key, spec, NUM_BLOCKS, cluster.config)
    dst_c, src = connect(cluster, a, c, key, spec)
    jobs = []
    for i in range(6):
        rx, dst = (b, dst_b) if i % 2 else (c, dst_c)
        ids = rx.call("reserve", key, f"f{i}", 3 + i, 0, src, 30.0)
        jobs.append((rx, Job(f"f{i}", dst, ids)))
    a.call("push", key, [job for _, job in jobs], 30.0)
    for rx, job in jobs:
        assert_landed(a, rx, key, job.request_id, job.dst_block_ids, 0)


@pytest.mark.parametrize("field, rx_spec", [
    ("num_kv_heads", Spec(num_layers=3, num_kv_heads=4, head_dim=8, block_size=16, dtype="float32")),
    ("dtype", Spec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16")),
])
def test_layout_mismatch_is_refused_naming_the_field_and_frees_blocks(cluster, field, rx_spec):
    a, c, key = cluster.peers["a"], cluster.peers["c"], cluster.key(f"mismatch-{field}")
    dst, src = connect(cluster, a, c, key, SPECS["fp32-L3-bs16"], rx_spec)
    free = c.call("num_free", key), a.call("num_free", key)
    ids = c.call("reserve", key, "bad", 4, 0, src, 30.0)
    a.call("push", key, [Job("bad", dst, ids)], 30.0)
    out_rx, out_tx = c.call("outcome", key, "bad", 30.0), a.call("outcome", key, "bad", 30.0)
    assert not out_rx.ok and f"mismatch on {field}" in out_rx.error
    assert not out_tx.ok and f"mismatch on {field}" in out_tx.error
    assert (c.call("num_free", key), a.call("num_free", key)) == free


def test_stalled_sender_fails_both_sides_within_the_deadline_then_the_pair_recovers(cluster):
    cluster.victim("doomed-sender")  # (only to pick the harnesses)
    a, c, spec, key = cluster.peers["a"], cluster.peers["c"], SPECS["bf16-L5-bs4"], cluster.key("stall-tx")
    dst, src = connect(cluster, a, c, key, spec)
    free = c.call("num_free", key), a.call("num_free", key)
    ids = c.call("reserve", key, "stuck", 4, 0, src, 1.5)
    a.call("push", key, [Job("stuck", dst, ids)], 1.5, 0.0, 2)  # the "model" stops after 2 of 5 layers
    out_rx, out_tx = c.call("outcome", key, "stuck", 30.0), a.call("outcome", key, "stuck", 30.0)
    assert not out_rx.ok and "deadline passed with 2/5 layers landed" in out_rx.error
    assert not out_tx.ok and ("deadline passed" in out_tx.error), out_tx.error
    assert out_rx.elapsed_s < 1.5 + SLACK_S and out_tx.elapsed_s < 1.5 + SLACK_S
    assert (c.call("num_free", key), a.call("num_free", key)) == free
    ids = c.call("reserve", key, "after", 4, 1, src, 30.0)
    a.call("push", key, [Job("after", dst, ids, 1)], 30.0)
    assert_landed(a, c, key, "after", ids, 1)


def wait_status(peer, key: str, rid: str, want: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while peer.call("status", key, rid) != want:
        assert time.monotonic() < deadline, f"{rid} never reached {want}"
        time.sleep(0.01)


def test_killed_sender_fails_the_receiver_within_the_deadline_and_frees_blocks(cluster):
    victim = cluster.victim("doomed-sender")
    c, spec, key = cluster.peers["c"], SPECS["bf16-L5-bs4"], cluster.key("kill-tx")
    dst, src = connect(cluster, victim, c, key, spec)
    free = c.call("num_free", key)
    ids = c.call("reserve", key, "orphan", 4, 0, src, 2.0)
    victim.call("push", key, [Job("orphan", dst, ids)], 2.0, 0.3)  # a slow model: 0.3 s per layer
    wait_status(c, key, "orphan", "TRANSFERRING")
    victim.kill()
    out = c.call("outcome", key, "orphan", 30.0)
    assert not out.ok and out.elapsed_s < 2.0 + SLACK_S, out
    assert "broke" in out.error or "deadline passed" in out.error or "unreachable" in out.error, out.error
    assert c.call("num_free", key) == free


def test_paused_then_killed_receiver_fails_the_sender_within_the_deadline(cluster):
    victim = cluster.victim("doomed-receiver")
    a, spec, key = cluster.peers["a"], SPECS["fp32-L3-bs16"], cluster.key("kill-rx")
    dst, src = connect(cluster, a, victim, key, spec)
    free = victim.call("num_free", key), a.call("num_free", key)
    land_once(a, victim, key, dst, src)  # a working link first

    ids = victim.call("reserve", key, "paused", 3, 0, src, 1.5)
    with paused(victim):
        a.call("push", key, [Job("paused", dst, ids)], 1.5)
        out_tx = a.call("outcome", key, "paused", 30.0)
        # every layer was out: the sender waits past its deadline for the (paused) receiver's verdict
        cfg = cluster.config
        assert not out_tx.ok and out_tx.elapsed_s < 1.5 + cfg.liveness_s + cfg.op_timeout_s + SLACK_S, out_tx
    out_rx = victim.call("outcome", key, "paused", 30.0)  # its own deadline passed while it was paused
    assert not out_rx.ok, out_rx
    assert (victim.call("num_free", key), a.call("num_free", key)) == free

    ids = victim.call("reserve", key, "dead", 3, 0, src, 2.0)
    victim.kill()
    a.call("push", key, [Job("dead", dst, ids)], 2.0)
    out_tx = a.call("outcome", key, "dead", 30.0)
    assert not out_tx.ok and out_tx.elapsed_s < 2.0 + SLACK_S, out_tx
    assert a.call("num_free", key) == free[1]


def test_a_verdict_slow_to_come_back_still_lands_on_both_sides(cluster):
    """Every layer is out before the sender's deadline, but the receiver (paused) acknowledges only after
    it: the receiver, whose own deadline is far, decides, so both sides report DONE (not FAILED/DONE)."""
    b = cluster.victim("b")  # paused and resumed, not killed
    a, spec, key = cluster.peers["a"], SPECS["fp32-L3-bs16"], cluster.key("slow-ack")
    # the pause must not break the link: no reply for liveness_s, or a message not taken for op_timeout_s
    config = dataclasses.replace(cluster.config, liveness_s=6.0, op_timeout_s=6.0)
    dst = b.call("open_receiver", key, spec, NUM_BLOCKS, config)
    src = a.call("open_sender", key, spec, NUM_BLOCKS, config)
    land_once(a, b, key, dst, src)  # a working link first

    ids = b.call("reserve", key, "late-ack", 3, 0, src, 30.0)
    with paused(b):
        a.call("push", key, [Job("late-ack", dst, ids)], 1.0)
        time.sleep(1.5)  # past the sender's deadline
        assert a.call("status", key, "late-ack") == "TRANSFERRING"  # waiting for the receiver's verdict
    assert_landed(a, b, key, "late-ack", ids, 0)
