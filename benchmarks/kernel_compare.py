"""The paged-attention kernel at a git ref against the working tree's, side by side in one process.

    python -m benchmarks.kernel_compare                 # HEAD's kernel against the working tree's
    python -m benchmarks.kernel_compare --ref 472485d   # any commit's
    python -m benchmarks.kernel_compare --json

Both kernels are built here (about a minute each, cached) and called in turn on the same inputs at
SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size 64, blocks of 16 tokens): one decode row per
sequence, each of the 30 layers its own cache so every step reads its KV from memory, as a real step does.
Each case keeps each kernel's best of 5 steps; the outputs must agree (1e-4). Float32 and bfloat16 caches
under float32 queries (`--kv-cache-dtype`). The ratio is the result: the milliseconds move with the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from engine.attention import KERNEL_PARTITION
from engine.kernels import CFLAGS, SOURCES, cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CASES = [(8, 16), (8, 1024), (32, 1024), (1, 4096), (8, 4096)]  # (batch, tokens of context)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_at(ref: str, workdir: Path, source: Path = SOURCES[0]) -> ModuleType:
    """The kernel `source` (a file of this repository) as it was at `ref`, built in `workdir`."""
    from torch.utils import cpp_extension

    rel = source.relative_to(Path(__file__).resolve().parents[1])
    safe = re.sub(r"\W", "_", ref)  # a module name and a file name (refs may hold ~ ^ / . -)
    src = workdir / f"{source.stem}_{safe}.cpp"
    src.write_text(subprocess.run(["git", "show", f"{ref}:{rel}"], check=True, capture_output=True,
                                  text=True, cwd=source.parent).stdout)
    progress(f"building {source.name} at {ref} (a minute or less)")
    return cpp_extension.load(name=f"{source.stem}_{safe}", sources=[str(src)], extra_cflags=CFLAGS,
                              extra_ldflags=["-fopenmp"], build_directory=str(workdir))


def step_ms(kernel: ModuleType, inputs: tuple, reps: int = 5) -> tuple[float, torch.Tensor]:
    q, k, v, tables, seqs = inputs
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for layer in range(LAYERS):
            kernel.paged_attention(out, q, k[layer], v[layer], tables, seqs, HEAD_DIM ** -0.5, KERNEL_PARTITION)
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out.clone()


def make_inputs(batch: int, ctx: int, dtype: torch.dtype) -> tuple:
    width = (ctx + BLOCK) // BLOCK  # the context and the new row
    blocks = batch * width + 8
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    ids = list(range(blocks))
    random.Random(0).shuffle(ids)  # blocks scattered through the cache
    tables = torch.tensor([ids[i * width:(i + 1) * width] for i in range(batch)], dtype=torch.int32)
    seqs = torch.tensor([(i, 1, ctx + 1) for i in range(batch)], dtype=torch.int32)
    return torch.randn(batch, HEADS, HEAD_DIM, generator=g), k, v, tables, seqs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="the git ref whose kernel is the baseline (default HEAD)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    after = cpu_kernels()
    if after is None:
        sys.exit("kernel_compare: the working tree's kernel could not be built here (see the log above)")
    with tempfile.TemporaryDirectory() as tmp:
        before = build_at(args.ref, Path(tmp))
        rows = []
        for batch, ctx in CASES:
            for dtype in (torch.float32, torch.bfloat16):
                inputs = make_inputs(batch, ctx, dtype)
                (t0, o0), (t1, o1) = step_ms(before, inputs), step_ms(after, inputs)
                if not torch.allclose(o0, o1, atol=1e-5, rtol=1e-4):
                    sys.exit(f"kernel_compare: the kernels disagree at batch {batch}, {ctx} tokens, {dtype}")
                rows.append({"batch": batch, "context": ctx, "cache_dtype": str(dtype).removeprefix("torch."),
                             "before_ms": t0, "after_ms": t1, "speedup": t0 / t1})
                progress(f"batch {batch} at {ctx} tokens, {rows[-1]['cache_dtype']} cache: {args.ref} {t0:.2f} ms, "
                         f"working tree {t1:.2f} ms per 30-layer step: {t0 / t1:.2f}x")
    if args.json:
        print(json.dumps({"ref": args.ref, "threads": args.threads, "cases": rows}, indent=2))
    else:
        print(f"{'case':<22}{'cache':<10}{args.ref + ' ms':>12}{'tree ms':>10}{'speed-up':>10}")
        for r in rows:
            case = f"batch {r['batch']}, {r['context']} tokens"
            print(f"{case:<22}{r['cache_dtype']:<10}"
                  f"{r['before_ms']:>12.2f}{r['after_ms']:>10.2f}{r['speedup']:>9.2f}x")


if __name__ == "__main__":
    main()
