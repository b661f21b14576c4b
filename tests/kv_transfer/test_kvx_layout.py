"""The wire layout and the config, without any transport: descriptors, refusals naming the field, packing."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVTransferConfig, LayoutMismatch, TransferDescriptor
from kv_transfer.layout import as_bytes, from_bytes, pack_layers, scatter_layers
from kv_transfer.wire import Header, LinkError, MsgKind

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.bfloat16)


def test_descriptor_round_trips_as_json():
    d = TransferDescriptor.for_spec("req-1", SPEC, (5, 2, 9))
    assert TransferDescriptor.from_bytes(d.to_bytes()) == d
    assert d.layer_shape == (2, 3, 16, 2, 8)
    assert d.layer_nbytes == 2 * 3 * 16 * 2 * 8 * 2


@pytest.mark.parametrize("field, receiver_spec", [
    ("num_layers", KVCacheSpec(5, 2, 8, 16, torch.bfloat16)),
    ("block_size", KVCacheSpec(4, 2, 8, 32, torch.bfloat16)),
    ("num_kv_heads", KVCacheSpec(4, 4, 8, 16, torch.bfloat16)),
    ("head_dim", KVCacheSpec(4, 2, 16, 16, torch.bfloat16)),
    ("dtype", KVCacheSpec(4, 2, 8, 16, torch.float16)),
])
def test_mismatch_is_refused_naming_the_field(field, receiver_spec):
    d = TransferDescriptor.for_spec("r", SPEC, (1, 2))
    with pytest.raises(LayoutMismatch, match=field) as info:
        d.check_fits(receiver_spec, (1, 2))
    assert info.value.field == field


def test_block_ids_must_be_the_reserved_ones():
    d = TransferDescriptor.for_spec("r", SPEC, (1, 2))
    with pytest.raises(LayoutMismatch, match="num_blocks"):
        d.check_fits(SPEC, (1, 2, 3))
    with pytest.raises(LayoutMismatch, match="dst_block_ids"):
        d.check_fits(SPEC, (2, 1))
    d.check_fits(SPEC, (1, 2))


@pytest.mark.parametrize("bad, field", [
    (dict(num_blocks=0, dst_block_ids=()), "num_blocks"),
    (dict(layer_start=3, layer_stop=3), "layer range"),
    (dict(dtype="int4"), "dtype"),
    (dict(request_id=""), "request_id"),
])
def test_descriptor_validates_fields(bad, field):
    fields = dict(request_id="r", num_blocks=1, layer_start=0, layer_stop=4, num_layers=4, block_size=16,
                  num_kv_heads=2, head_dim=8, dtype="bfloat16", dst_block_ids=(0,))
    with pytest.raises(ValueError, match=field):
        TransferDescriptor(**{**fields, **bad})


def test_malformed_descriptor_bytes_are_a_value_error():
    with pytest.raises(ValueError, match="malformed"):
        TransferDescriptor.from_bytes(b"{not json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_pack_then_scatter_moves_blocks_bit_for_bit(dtype):
    spec = KVCacheSpec(3, 2, 4, 8, dtype)
    src, dst = KVCache(spec, 10), KVCache(spec, 12)
    src.tensor.view(torch.uint8).copy_(torch.randint(0, 256, src.tensor.view(torch.uint8).shape, dtype=torch.uint8))
    src_ids, dst_ids = [7, 0, 3], [11, 4, 5]
    desc = TransferDescriptor.for_spec("r", spec, tuple(dst_ids))
    for first, count in ((0, 1), (1, 2)):  # one layer, then two coalesced into one message
        wire = as_bytes(pack_layers(src.tensor, first, count, torch.tensor(src_ids)))
        assert wire.dtype == torch.uint8 and wire.numel() == count * desc.layer_nbytes
        scatter_layers(dst.tensor, first, torch.tensor(dst_ids), from_bytes(wire.clone(), desc))
    assert torch.equal(src.tensor[:, :, src_ids].view(torch.uint8), dst.tensor[:, :, dst_ids].view(torch.uint8))
    untouched = [b for b in range(12) if b not in dst_ids]
    assert not dst.tensor[:, :, untouched].any()


def test_header_round_trip_and_version_check():
    h = Header(MsgKind.LAYER, seq=3, layer=29, nbytes=1 << 33)
    assert Header.from_tensor(h.to_tensor()) == h
    t = h.to_tensor()
    t[0] = 99
    with pytest.raises(LinkError, match="protocol"):
        Header.from_tensor(t)


@pytest.mark.parametrize("bad, field", [
    (dict(kv_transport="zmq"), "kv_transport"),
    (dict(rendezvous_host=None), "rendezvous_host"),
    (dict(rendezvous_port=None), "rendezvous_port"),
    (dict(op_timeout_s=0), "op_timeout_s"),
    (dict(keepalive_s=1.0, liveness_s=1.5), "liveness_s"),
])
def test_config_validates_fields(bad, field):
    with pytest.raises(ValueError, match=field):
        KVTransferConfig(**{**dict(rendezvous_host="10.0.0.1", rendezvous_port=29500), **bad})
    KVTransferConfig(kv_transport="ray")  # the Ray fallback needs no rendezvous
