"""vLLM's CPU KV block layout, and the mapping to pdserve's: the one module that knows both.

vLLM's CPU attention backend registers one tensor per layer, [num_blocks, kv_heads, block_size, 2 * head_dim],
which its kernels read as [num_blocks, kv_heads, 2 * block_size, head_dim] and chunk into keys and values
(`vllm/v1/attention/backends/cpu_attn.py`, `do_kv_cache_update`). Inside one block and head the two halves
are NOT laid out alike: the `vec` and `vec16` kernels write each head's **keys column-major, [head_dim,
block_size]**, and its **values row-major, [block_size, head_dim]** (`csrc/cpu/cpu_attn_vec.hpp`,
`reshape_and_cache`: "Write Key as column-major"; `k_cache_token_group_stride`: "layout of k_cache block is
[head_dim, block_size]"). Measured with vLLM's own `cpu_attn_reshape_and_cache` in
`tests/engine/test_vllm_layout.py`. The `amx` kernel packs both another way: refused at start.

Two views, for two jobs:

- `VllmCpuLayout.blocks`: vLLM's memory as one `KVCache` of pdserve's *shape*, [layers, 2, blocks, block_size,
  kv_heads, head_dim], without a copy; its bytes are in vLLM's order (a block's keys are transposed in it).
  This is what the KV transport ships and the staging cache receives: whole blocks, bit for bit, between two
  vLLM CPU engines of one layout. It cannot be read token by token.
- `to_pdserve` (a copy): blocks in vLLM's order, taken from that view or from a staging cache that received
  them, as pdserve's layout proper. Everything that reads KV *by position* goes through it: `tokens_of`, the
  digests of `--verify-kv-moves`, a drain's checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.kv_cache import KVCache, KVCacheSpec, read_positions

# the CPU kernels whose block interiors this module maps (keys [head_dim, block_size], values [block_size, head_dim])
SUPPORTED_ISAS = ("vec", "vec16")


class VllmCpuLayout:
    """vLLM's per-layer CPU caches as one pdserve-shaped `KVCache` over the same memory (`blocks`)."""

    def __init__(self, spec: KVCacheSpec, blocks: KVCache) -> None:
        self.spec = spec
        self.blocks = blocks

    @classmethod
    def for_engine(cls, kv_caches: Mapping[str, torch.Tensor], vllm_config: Any, block_size: int) -> VllmCpuLayout:
        """The view over a running vLLM engine's caches, for the attention kernel its CPU backend picks."""
        first = next(iter(kv_caches.values()))
        if first.device.type != "cpu":
            raise NotImplementedError(f"the pdserve connector maps vLLM's CPU KV layout only; this engine's cache is "
                                      f"on {first.device}")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model_dtype: Any = vllm_config.model_config.dtype  # a torch.dtype once vLLM resolved it
        # NOTE: the kernel as `CPUAttentionMetadataBuilder` picks it, from the same four values
        isa = _get_attn_isa(model_dtype, block_size, first.shape[-1] // 2, vllm_config.cache_config.cache_dtype)
        return cls.over(kv_caches, block_size, isa)

    @classmethod
    def over(cls, kv_caches: Mapping[str, torch.Tensor], block_size: int, isa: str) -> VllmCpuLayout:
        """The view over vLLM's registered caches (every layer in one storage, layer after layer), for the
        attention kernel `isa` vLLM picked. Raises, naming what differs, on a layout it cannot map."""
        if isa not in SUPPORTED_ISAS:
            raise NotImplementedError(f"vLLM's CPU attention kernel {isa!r} packs its KV blocks in a layout the "
                                      f"pdserve connector does not map (supported: {', '.join(SUPPORTED_ISAS)})")
        layers = list(kv_caches.values())
        assert layers, "vLLM registered no KV caches with the pdserve connector"
        first = layers[0]
        if first.dim() != 4 or first.shape[3] % 2:
            raise NotImplementedError(f"vLLM's KV cache has shape {tuple(first.shape)}, not the CPU backend's "
                                      "[blocks, kv_heads, block_size, 2 * head_dim]")
        n, heads, bs, two_d = first.shape
        if bs != block_size:
            raise ValueError(f"vLLM's KV cache has blocks of {bs} tokens; CacheConfig.block_size asked {block_size}")
        step = first.numel()
        if any(t.shape != first.shape or t.data_ptr() - first.data_ptr() != i * step * t.element_size()
               for i, t in enumerate(layers)):
            raise NotImplementedError("vLLM's KV layers are not one storage layer after layer; this vLLM "
                                      "version's cache layout is not supported by the pdserve connector")
        whole = torch.as_strided(first, (len(layers), *first.shape), (step, *first.stride()),
                                 first.storage_offset())
        head_dim = two_d // 2
        # [L, N, H, 2, bs * D] -> [L, 2, N, bs, H, D]: pdserve's shape; a key block's bytes stay [D, bs]
        view = whole.view(len(layers), n, heads, 2, bs, head_dim).permute(0, 3, 1, 4, 2, 5)
        spec = KVCacheSpec(len(layers), heads, head_dim, bs, first.dtype)
        return cls(spec, KVCache.over(spec, view))


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    """How many KV heads each of `tp_size` tensor-parallel ranks holds (`heads_of_rank`)."""
    return max(1, total_heads // tp_size)


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> slice:
    """The KV heads tensor-parallel `rank` of `tp_size` holds, as vLLM splits them (`QKVParallelLinear`): an
    equal share each, or one head on `tp_size // total_heads` ranks each when there are fewer heads than
    ranks."""
    count = heads_per_rank(total_heads, tp_size)
    replicas = max(1, tp_size // total_heads)
    first = rank // replicas * count
    return slice(first, first + count)


def to_pdserve(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks in vLLM's byte order, [layers, 2, n, block_size, kv_heads, head_dim] (a gather from
    `VllmCpuLayout.blocks` or from a staging cache that received them), as pdserve's layout (a copy)."""
    layers, _, n, bs, heads, dim = blocks.shape
    # each (block, head)'s keys are bs * D values in vLLM's order, [D, bs]: read them so, then put tokens first
    keys = blocks[:, 0].permute(0, 1, 3, 2, 4).reshape(layers, n, heads, dim, bs).permute(0, 1, 4, 2, 3)
    return torch.stack((keys, blocks[:, 1]), dim=1)


def from_pdserve(kv: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_pdserve`: blocks in pdserve's layout as vLLM's CPU kernels store them (a copy)."""
    layers, _, n, bs, heads, dim = kv.shape
    keys = kv[:, 0].permute(0, 1, 3, 4, 2).reshape(layers, n, heads, bs, dim).permute(0, 1, 3, 2, 4)
    return torch.stack((keys, kv[:, 1]), dim=1)


def tokens_of(blocks: torch.Tensor, block_ids: Sequence[int], num_tokens: int, start: int = 0) -> torch.Tensor:
    """K and V of a sequence's positions `start` to `num_tokens`, [layers, 2, num_tokens - start, kv_heads,
    head_dim], from its blocks in a cache whose bytes are in vLLM's order (`VllmCpuLayout.blocks.tensor` or a
    staging cache); only the blocks holding those positions are read."""
    return read_positions(blocks, block_ids, num_tokens, start, to_pdserve)
