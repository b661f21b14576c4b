"""Ad hoc (2026-12-07, as it ran but for its copy onto 2 MB pages: it ran with the first run's own mmap
helper, here the engine's `huge_page_zeros`, which advises the same mapping before first touch): the GGUF
kernel over gguf_compare's shapes with each layer's blocks on 4 KB pages and copied onto 2 MB pages, ABBA x 3.
    PYTHONPATH=. python benchmarks/results/kv-huge-pages-2026-12-07/weights_pages_ab.py"""
import torch

from benchmarks.gguf_compare import SHAPES, shape_ms, weights
from engine.kernels import gguf_kernels
from engine.kv_cache import huge_page_zeros


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    return huge_page_zeros(tuple(t.shape), t.dtype).copy_(t)


k = gguf_kernels()
torch.set_num_threads(2)
for rows in (8, 32):
    tot = {"4k": 0.0, "huge": 0.0}
    for name, (n, kk, kind, count) in SHAPES.items():
        layers = weights(n, kk, kind, count)
        hl = [[huge_copy(p) for p in parts] for parts in layers]
        x = torch.randn(rows, kk)
        a, b = [], []
        for _ in range(3):
            for which in ("4k", "huge", "huge", "4k"):
                ms, _ = shape_ms(k, kind, x, layers if which == "4k" else hl)
                (a if which == "4k" else b).append(ms)
        tot["4k"] += min(a)
        tot["huge"] += min(b)
        print(f"rows {rows} {name}: 4k {min(a):.2f} huge {min(b):.2f} ratio {min(a)/min(b):.3f}", flush=True)
    print(f"rows {rows} total: 4k {tot['4k']:.1f} huge {tot['huge']:.1f} ratio {tot['4k']/tot['huge']:.3f}")
