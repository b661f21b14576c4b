"""The KV cache's memory on a CPU: zeroed, resident from the start, on transparent huge pages where Linux
gives them, and given back when the cache goes."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
BLOCKS = 1024  # 4 x 2 x 1024 x 12 KB = 96 MB


def _mapping(ptr: int) -> dict[str, int]:
    """The kB fields of the /proc/self/smaps entry of the mapping that holds address `ptr`."""
    text = Path("/proc/self/smaps").read_text()
    entry = r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n(.*?)(?=^[0-9a-f]+-[0-9a-f]+ |\Z)"
    for m in re.finditer(entry, text, re.S | re.M):
        if int(m.group(1), 16) <= ptr < int(m.group(2), 16):
            return {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", m.group(3), re.M)}
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_a_cpu_cache_is_zeroed_writable_and_every_dtype_fits():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        spec = KVCacheSpec(2, 3, 64, 16, dtype)
        cache = KVCache(spec, 700)  # over 2 MB in every dtype: the mapped path
        assert cache.tensor.shape == (2, 2, 700, 16, 3, 64) and cache.tensor.dtype == dtype
        assert cache.tensor.is_contiguous() and not cache.tensor.float().any()
        k, v = cache.layer(1)
        k[3, 5] = 1.5
        assert cache.tensor[1, 0, 3, 5].float().eq(1.5).all() and not cache.tensor[1, 1].float().any()
    tiny = KVCache(KVCacheSpec(1, 1, 8, 4, torch.float32), 2)  # under 2 MB: torch's own allocation
    assert not tiny.tensor.any()


@pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this machine")
def test_the_cache_sits_on_huge_pages_is_resident_at_start_and_is_freed_with_the_cache():
    before = _rss_kb()
    cache = KVCache(SPEC, BLOCKS)
    nbytes = cache.tensor.numel() * cache.tensor.element_size()
    fields = _mapping(cache.tensor.data_ptr())
    # resident now, not at first use (a cache too big for the machine fails at start)
    assert fields["Rss"] * 1024 >= nbytes and _rss_kb() - before >= nbytes // 1024 * 0.95
    # most of it on 2 MB pages (the kernel may lack free ones for a few: not a failure of ours)
    assert fields["AnonHugePages"] * 1024 >= nbytes // 2, fields
    view = cache.layer(2)[0]
    del cache
    gc.collect()
    assert _rss_kb() - before >= nbytes // 1024 * 0.95  # a view keeps the memory alive
    del view
    gc.collect()
    assert _rss_kb() - before < nbytes // 1024 // 4
