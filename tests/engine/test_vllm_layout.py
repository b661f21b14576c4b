"""pdserve's view of vLLM's CPU KV cache (`engine.vllm_layout`), against what vLLM's own kernel writes.

vLLM's CPU kernel stores a block's keys [head_dim, block_size] and its values [block_size, head_dim]. The
first test writes known K and V through vLLM's `cpu_attn_reshape_and_cache` (the op its attention layers
call) into caches laid out as vLLM registers them, then reads them back by position (skipped without vLLM);
the others need only torch.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.vllm_layout import VllmCpuLayout, from_pdserve, to_pdserve, tokens_of

HAS_VLLM = importlib.util.find_spec("vllm") is not None
L, N, H, BS, D = 3, 5, 2, 128, 64


def _vllm_caches(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-layer caches as vLLM's CPU worker registers them: one storage, layer after layer."""
    storage = torch.zeros(L, N, H, BS, 2 * D, dtype=dtype)
    return storage, {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(L)}


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (docs/vllm_backend.md)")
@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_read_back_as_vllms_kernel_wrote_them(isa, dtype):
    from vllm import _custom_ops as ops

    storage, caches = _vllm_caches(dtype)
    torch.manual_seed(0)
    # a sequence of 137 tokens over blocks 3 and 1 (a full block, then 9 tokens), plus stale data after them
    n = BS + 9
    table = [3, 1]
    keys, values = torch.randn(L, n + 5, H, D).to(dtype), torch.randn(L, n + 5, H, D).to(dtype)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n + 5)])
    for layer in range(L):
        k_cache, v_cache = storage[layer].view(N, H, 2 * BS, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys[layer], values[layer], k_cache, v_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    layout = VllmCpuLayout.over(caches, BS, isa)
    got = tokens_of(layout.blocks.tensor, table, n)  # [L, 2, n, H, D]
    assert torch.equal(got[:, 0], keys[:, :n]) and torch.equal(got[:, 1], values[:, :n])
    # NOTE: read by position without the mapping (what `VllmEngine._view_cache` gave the digests and drains
    # before this module), the keys come out wrong: they are stored transposed
    naive = layout.blocks.tensor[:, :, table].flatten(2, 3)[:, :, :n]
    assert torch.equal(naive[:, 1], values[:, :n]) and not torch.equal(naive[:, 0], keys[:, :n])
    # the transport's blocks are vLLM's bytes: shipped whole into a pdserve-shaped staging cache, they read
    # back the same way
    staging = torch.zeros(L, 2, 4, BS, H, D, dtype=dtype)
    staging[:, :, [2, 0]] = layout.blocks.tensor[:, :, table]
    assert torch.equal(tokens_of(staging, [2, 0], n), got)
    for start in (1, BS, BS + 1, n - 1):  # from a position on (within the first block, on its end, past it)
        assert torch.equal(tokens_of(layout.blocks.tensor, table, n, start), got[:, :, start:])


def test_the_view_is_vllms_memory_and_the_mapping_round_trips():
    storage, caches = _vllm_caches()
    layout = VllmCpuLayout.over(caches, BS, "vec")
    assert layout.spec.block_shape == (BS, H, D) and layout.spec.num_layers == L
    assert layout.blocks.tensor.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    kv = torch.randn(L, 2, 4, BS, H, D)
    assert torch.equal(to_pdserve(from_pdserve(kv)), kv)
    # a key written through the view at (layer 1, block 2, head 1) lands [D, BS] in vLLM's tensor
    layout.blocks.tensor[:, :, [2]] = from_pdserve(kv[:, :, :1])
    keys, values = storage[1, 2, 1].view(2 * BS * D).split(BS * D)  # vLLM reads [2 * BS, D]: K, then V
    assert torch.equal(keys.view(D, BS).T, kv[1, 0, 0, :, 1]) and torch.equal(values.view(BS, D), kv[1, 1, 0, :, 1])


def test_layouts_it_cannot_map_are_refused():
    _, caches = _vllm_caches()
    with pytest.raises(NotImplementedError, match="amx"):
        VllmCpuLayout.over(caches, BS, "amx")
    with pytest.raises(ValueError, match="block_size"):
        VllmCpuLayout.over(caches, 16, "vec")
    apart = {name: t.clone() for name, t in caches.items()}
    with pytest.raises(NotImplementedError, match="layer after layer"):
        VllmCpuLayout.over(apart, BS, "vec")
