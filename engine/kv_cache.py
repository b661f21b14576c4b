"""The paged KV cache: one tensor per worker, addressed by block id.

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. A block holds `block_size`
consecutive tokens of one sequence for every layer; `cache[l, 0, b]` is layer l's keys of block b, a
contiguous [block_size, num_kv_heads, head_dim] slab, which is what the KV-transfer layer ships.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import cdiv

# the 8-bit float cache dtypes (`engine.config.FP8_KV_DTYPES`)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded into a cache of `dtype`. An 8-bit float saturates at its largest finite value: torch's
    conversion does so for e4m3 (448) but makes e5m2's overflow infinite, which attention would turn into
    NaN."""
    if dtype in FP8:
        most = torch.finfo(dtype).max
        x = x.clamp(-most, most)
    return x.to(dtype)


def index_copy(dest: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dest.index_copy_(dim, index, src)` for every cache dtype: torch has no CPU index_copy_ for 8-bit
    floats, so those move as the bytes they are (`src` already in `dest`'s dtype)."""
    if dest.dtype in FP8:
        dest, src = dest.view(torch.uint8), src.view(torch.uint8)
    dest.index_copy_(dim, index, src)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory advised for transparent huge pages (Linux), else `torch.zeros`.

    NOTE: decode attention reads each sequence's blocks wherever they lie in the cache, a few KB at a time,
    over gigabytes: over 4 KB pages nearly every block read misses the TLB. Over 2 MB pages the
    paged-attention kernel ran 1.06-1.28x faster (SmolLM2's shapes, 30 layers, blocks shuffled through the
    cache, 2 threads, two runs, 2026-12-07; docs/engine.md#huge-pages). The weights, read in order, gained
    1-2%, so only the cache asks. The memory is touched here, as `torch.zeros` does, so a cache too large for
    the machine fails at start, not mid-serving. Where the kernel gives no huge pages (THP set to `never`,
    or none free) this is plain memory: the same tensor, only slower to read."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if sys.platform != "linux" or nbytes < 2 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # (a kernel built without THP: plain pages)
        buf.madvise(mmap.MADV_HUGEPAGE)
    # (the tensor holds `buf` alive; the mapping goes when the last view of the cache does)
    tensor = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    return tensor.zero_()


@dataclass(frozen=True)
class KVCacheSpec:
    """What two caches must agree on for blocks to move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K and V of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_per_layer


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (spec.num_layers, 2, num_blocks, *spec.block_shape)
        self.tensor = (huge_page_zeros(shape, spec.dtype) if torch.device(device).type == "cpu"
                       else torch.zeros(shape, dtype=spec.dtype, device=device))

    @classmethod
    def over(cls, spec: KVCacheSpec, tensor: torch.Tensor) -> KVCache:
        """A cache over another engine's memory: `tensor` is [num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim], a view that need not be contiguous (vLLM's layout, permuted)."""
        assert tensor.shape == (spec.num_layers, 2, tensor.shape[2], *spec.block_shape), tensor.shape
        cache = cls.__new__(cls)
        cache.spec, cache.num_blocks, cache.tensor = spec, tensor.shape[2], tensor
        return cache

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s (keys, values), each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.tensor[layer, 0], self.tensor[layer, 1]

    @staticmethod
    def num_blocks_for_memory(spec: KVCacheSpec, num_bytes: int) -> int:
        return max(1, num_bytes // spec.bytes_per_block)


def read_positions(blocks: torch.Tensor, block_ids: Sequence[int], num_tokens: int, start: int = 0,
                   convert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """K and V of a sequence's positions `start` to `num_tokens`, [layers, 2, num_tokens - start, kv_heads,
    head_dim], from its `block_ids` in `blocks` ([layers, 2, num_blocks, block_size, kv_heads, head_dim]);
    only the blocks holding those positions are read, then `convert`ed (a layout's byte order) if given."""
    block_size = blocks.shape[3]
    first = start // block_size
    gathered = blocks[:, :, list(block_ids[first:cdiv(num_tokens, block_size)])]
    if convert is not None:
        gathered = convert(gathered)
    skip = first * block_size
    return gathered.flatten(2, 3)[:, :, start - skip:num_tokens - skip]
