"""The paged-attention kernel alone over float32, bfloat16 and 8-bit float caches, an ad hoc run kept beside
its output (kernel-alone.txt):

    python benchmarks/results/engine-context-fp8kv-2026-12-07/kernel_alone.py

SmolLM2-135M's shapes (30 layers, each its own cache, 9 query and 3 KV heads of 64, blocks of 16 tokens in a
random order), one decode row per sequence, best of 5 steps, 2 threads; milliseconds per 30-layer step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.attention import KERNEL_PARTITION  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def step_ms(kernel, batch: int, context: int, dtype: torch.dtype) -> float:
    blocks = batch * (context // BLOCK)
    k = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(blocks).to(torch.int32).view(batch, -1)
    seqs = torch.tensor([(i, 1, context) for i in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            kernel.paged_attention(out, q, k[layer], v[layer], tables, seqs, HEAD_DIM ** -0.5, KERNEL_PARTITION)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    kernel = cpu_kernels()
    torch.set_num_threads(2)
    for batch, context in ((8, 1024), (32, 1024), (8, 4096)):
        row = {str(d).removeprefix("torch."): round(step_ms(kernel, batch, context, d), 2) for d in DTYPES}
        print(f"batch {batch}, {context} tokens of context: {row}", flush=True)


if __name__ == "__main__":
    main()
