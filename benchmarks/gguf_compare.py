"""The GGUF matmul kernel at a git ref against the working tree's, side by side in one process.

    python -m benchmarks.gguf_compare                        # HEAD's kernel against the working tree's
    python -m benchmarks.gguf_compare --ref 865fe1d --rows 8,28,32 --json

Both kernels are built here (about 30 s each; the ref must have `engine/kernels/gguf_matmul.cpp`) and called
in turn on the same inputs: a decode step's matmuls at SmolLM2-135M's shapes and GGUF types (the fused qkv, o,
gate and up, down: Q4_1; the tied lm_head: Q8_0), each of the 30 layers its own blocks so every step streams
its weights from memory, as a real step does, at each batch width (`--rows`, rows of x). Per shape and width,
the kernels alternate (ABBA) and each keeps the better of its two medians of 9 passes; the outputs must agree
(to 1e-5 of the largest). The ratio is the result: the milliseconds move with the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from benchmarks.kernel_compare import build_at, progress
from engine.kernels import GGUF_SOURCES, gguf_kernels
from engine.quant import BlockQuantized

LAYERS = 30
# name: (N, K, GGUF type, how many a step runs)
SHAPES = {"qkv": (960, 576, "Q4_1", LAYERS), "o": (576, 576, "Q4_1", LAYERS),
          "gate_up": (3072, 576, "Q4_1", LAYERS), "down": (576, 1536, "Q4_1", LAYERS),
          "lm_head": (49152, 576, "Q8_0", 1)}
Parts = list[torch.Tensor]


def weights(n: int, k: int, kind: str, count: int) -> list[Parts]:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    b = BlockQuantized.from_gguf(kind, quantize(w, GGMLQuantizationType[kind]), n)
    parts = [p for p in (b.codes, b.scales, b.offsets) if p is not None]
    return [[p.clone() for p in parts] for _ in range(count)]


def shape_ms(kernel: ModuleType, kind: str, x: torch.Tensor, layers: list[Parts]) -> tuple[float, torch.Tensor]:
    """Median ms of 9 passes over every layer's blocks, and the last layer's output."""
    run = kernel.q8_0_linear if kind == "Q8_0" else kernel.q4_1_linear
    times = []
    for _ in range(10):
        start = time.perf_counter()
        for parts in layers:
            out = run(x, *parts)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="the git ref whose kernel is the baseline (default HEAD)")
    parser.add_argument("--rows", default="1,8,32", help="batch widths, comma-separated (default 1,8,32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    args = parser.parse_args(argv)
    try:
        widths = [int(r) for r in args.rows.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1 or len(set(widths)) != len(widths):
        parser.error(f"--rows: {args.rows!r} is not a comma-separated list of distinct positive integers, "
                     "e.g. 1,8,32")
    torch.set_num_threads(args.threads)
    after = gguf_kernels()
    if after is None:
        sys.exit("gguf_compare: the working tree's kernel could not be built here (see the log above)")
    progress("quantising the weights (gguf's own quantiser)")
    blocks = {name: weights(*shape) for name, shape in SHAPES.items()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            before = build_at(args.ref, Path(tmp), GGUF_SOURCES[0])
        except subprocess.CalledProcessError as e:
            parser.error(f"--ref {args.ref}: no engine/kernels/gguf_matmul.cpp there ({e.stderr.strip()})")
        for m in widths:
            for name, (_, k, kind, _) in SHAPES.items():
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                (a0, o0), (b0, o1) = shape_ms(before, kind, x, blocks[name]), shape_ms(after, kind, x, blocks[name])
                (b1, _), (a1, _) = shape_ms(after, kind, x, blocks[name]), shape_ms(before, kind, x, blocks[name])
                if (o0 - o1).abs().max() > 1e-5 * o1.abs().max():  # (the sums' order may differ)
                    sys.exit(f"gguf_compare: the kernels disagree at {m} rows, {name}")
                t0, t1 = min(a0, a1), min(b0, b1)
                rows.append({"rows": m, "shape": name, "before_ms": t0, "after_ms": t1, "speedup": t0 / t1})
                progress(f"{m} rows, {name}: {args.ref} {t0:.2f} ms, working tree {t1:.2f} ms: {t0 / t1:.2f}x")
            step = [r for r in rows if r["rows"] == m]
            t0, t1 = sum(r["before_ms"] for r in step), sum(r["after_ms"] for r in step)
            rows.append({"rows": m, "shape": "step", "before_ms": t0, "after_ms": t1, "speedup": t0 / t1})
    if args.json:
        print(json.dumps({"ref": args.ref, "threads": args.threads, "cases": rows}, indent=2))
    else:
        print(f"{'rows':>5} {'shape':<9}{args.ref + ' ms':>12}{'tree ms':>10}{'speed-up':>10}")
        for r in rows:
            print(f"{r['rows']:>5} {r['shape']:<9}{r['before_ms']:>12.2f}{r['after_ms']:>10.2f}{r['speedup']:>9.2f}x")


if __name__ == "__main__":
    main()
