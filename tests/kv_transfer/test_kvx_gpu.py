"""The CUDA path: caches on the GPU, packing on a side stream behind the compute's event, NCCL between two
GPUs (gloo with host staging when both ends share one GPU, which NCCL refuses). Skipped without CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch
from kvx_harness import HOST, Job, ProcessPeer, Spec, make_config

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import create_receiver, create_sender

pytestmark = pytest.mark.gpu

SPEC = KVCacheSpec(num_layers=6, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)


def test_layers_written_on_a_compute_stream_are_packed_only_after_the_compute(rendezvous):
    """The sender must wait for the event `send_layer` records: each layer is written after a long GPU sleep
    on the compute stream, so packing without waiting would ship stale bytes."""
    cfg = make_config("torch", rendezvous.port)
    tx, rx = KVCache(SPEC, 32, "cuda"), KVCache(SPEC, 32, "cuda")
    sender = create_sender(cfg, "gpu-prefill", tx, HOST)
    receiver = create_receiver(cfg, "gpu-decode", rx, HOST)
    try:
        src, dst = [3, 9, 4, 20], [31, 0, 17, 8]
        receiver.expect("g", "gpu-prefill", dst, time.monotonic() + 30)
        sender.begin("g", receiver.address, src, dst, time.monotonic() + 30)
        truth = torch.randn(SPEC.num_layers, 2, len(src), *SPEC.block_shape, device="cuda").to(SPEC.dtype)
        compute = torch.cuda.Stream()
        compute.wait_stream(torch.cuda.current_stream())  # `truth` was made on the default stream
        with torch.cuda.stream(compute):
            for layer in range(SPEC.num_layers):
                torch.cuda._sleep(20_000_000)  # a slow "layer"
                tx.tensor[layer, :, src] = truth[layer]
                sender.send_layer("g", layer)
        assert receiver.wait("g", 30).ok and sender.wait("g", 30).ok
        assert torch.equal(rx.tensor[:, :, dst].view(torch.uint8), truth.view(torch.uint8))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("devices", [
    pytest.param(("cuda:0", "cuda:0"), id="one-gpu-gloo"),
    pytest.param(("cuda:0", "cuda:1"), id="two-gpus-nccl", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")),
])
def test_blocks_arrive_bit_for_bit_between_processes_on_cuda(rendezvous, devices):
    cfg = make_config("torch", rendezvous.port)
    a, c = ProcessPeer(f"gpu-a-{devices[1]}"), ProcessPeer(f"gpu-c-{devices[1]}")
    try:
        spec = Spec(num_layers=4, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
        dst = c.call("open_receiver", "k", spec, 64, cfg, devices[1])
        src = a.call("open_sender", "k", spec, 64, cfg, devices[0])
        free = c.call("num_free", "k"), a.call("num_free", "k")
        for rid, n, skip in (("r1", 8, 0), ("r2", 5, 2)):
            ids = c.call("reserve", "k", rid, n, skip, src, 60.0)
            a.call("push", "k", [Job(rid, dst, ids, skip)], 60.0)
            out_rx, out_tx = c.call("outcome", "k", rid, 60.0), a.call("outcome", "k", rid, 60.0)
            assert out_rx.ok and out_tx.ok, (out_rx.error, out_tx.error)
            sent, got = a.call("sent", "k", rid), c.call("blocks", "k", ids)
            assert torch.equal(sent[:, :, skip:].view(torch.uint8), got[:, :, skip:].view(torch.uint8))
            c.call("release", "k", rid)
        assert (c.call("num_free", "k"), a.call("num_free", "k")) == free
    finally:
        a.shutdown()
        c.shutdown()
