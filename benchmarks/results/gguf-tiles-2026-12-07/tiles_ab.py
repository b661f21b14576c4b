"""Ad hoc (2026-12-07): a decode step's GGUF matmuls at SmolLM2's shapes (each layer its own blocks, so the
weights stream from memory as in a step), 2 threads, for kernels built from copies of
`engine/kernels/gguf_matmul.cpp` at /tmp/gm/gm_NAME.cpp (base: the commit before the tiles; new: the tiles
by batch). Output: tiles_ab.txt.

    MS=1,2,4,8,16,32 python tiles_ab.py base new
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch.utils import cpp_extension

from engine.kernels import CFLAGS
from engine.quant import BlockQuantized

# name: (N, K, GGUF type, how many a step runs)
SHAPES = {"qkv": (960, 576, "Q4_1", 30), "o": (576, 576, "Q4_1", 30), "gate_up": (3072, 576, "Q4_1", 30),
          "down": (576, 1536, "Q4_1", 30), "lm_head": (49152, 576, "Q8_0", 1)}


def median_s(f, n: int = 15) -> float:
    f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def main() -> None:
    mods = {}
    for name in sys.argv[1:]:
        build = Path(f"/tmp/gm/build_{name}")
        build.mkdir(parents=True, exist_ok=True)
        mods[name] = cpp_extension.load(name=f"gm_{name}", sources=[f"/tmp/gm/gm_{name}.cpp"],
                                        extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                        build_directory=str(build), verbose=False)
    torch.set_num_threads(2)
    weights = {}
    for name, (n, k, kind, count) in SHAPES.items():
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        b = BlockQuantized.from_gguf(kind, quantize(w, GGMLQuantizationType[kind]), n)
        parts = [p for p in (b.codes, b.scales, b.offsets) if p is not None]
        weights[name] = [[p.clone() for p in parts] for _ in range(count)]
    for _ in range(2):
        for m in (int(x) for x in os.environ.get("MS", "1,8,32").split(",")):
            for name, mod in mods.items():
                x = {k: torch.randn(m, k) for k in (576, 1536)}

                def step(mod=mod, x=x) -> None:
                    for shape, (_, k, kind, _) in SHAPES.items():
                        run = mod.q8_0_linear if kind == "Q8_0" else mod.q4_1_linear
                        for parts in weights[shape]:
                            run(x[k], *parts)

                print(f"M={m} {name}: {median_s(step) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
