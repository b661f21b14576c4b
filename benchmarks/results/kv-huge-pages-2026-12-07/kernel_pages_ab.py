"""Ad hoc (2026-12-07, kept as it ran): the paged-attention kernel over the same KV on 4 KB pages (torch's
allocation) and on 2 MB pages (a mapping advised MADV_HUGEPAGE before first touch), ABBA x 4, best of each.
SmolLM2's shapes, 30 layers, blocks shuffled through the cache (benchmarks.kernel_compare's inputs).
    PYTHONPATH=. python benchmarks/results/kv-huge-pages-2026-12-07/kernel_pages_ab.py"""
import mmap

import torch

from benchmarks.kernel_compare import make_inputs, step_ms
from engine.kernels import cpu_kernels


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    n = t.numel() * t.element_size()
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape).copy_(t)


kernels = cpu_kernels()
torch.set_num_threads(2)
for batch, ctx in [(32, 1024), (8, 1024), (1, 4096), (8, 4096)]:
    q, k, v, tables, seqs = make_inputs(batch, ctx, torch.float32)  # (torch's allocator: 4 KB pages)
    kh, vh = huge_copy(k), huge_copy(v)
    small, huge = [], []
    for _ in range(4):
        for name in ("4k", "2m", "2m", "4k"):
            ms, _ = step_ms(kernels, (q, k, v, tables, seqs) if name == "4k" else (q, kh, vh, tables, seqs))
            (small if name == "4k" else huge).append(ms)
    print(f"batch {batch}, {ctx} tokens: 4 KB pages {min(small):.1f} ms, 2 MB pages {min(huge):.1f} ms, "
          f"{min(small) / min(huge):.2f}x", flush=True)
