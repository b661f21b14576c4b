"""A bfloat16 SmolLM2 on the CPU with its weights packed for oneDNN (`engine.models.llama.Matmul`) against
F.linear, beside the float32 model; an ad hoc run kept with its output (bf16-packed.txt):

    python benchmarks/results/engine-bf16-packed-2026-12-07/bf16_packed.py

Each engine in turn (float32, bfloat16 plain, bfloat16 packed, then again in reverse): the median decode step
at batch 1 and 8 over 16-token prompts and at batch 8 over 1,024-token ones (prompts prefix-cached first),
and one 512-token prefill step; 2 threads, milliseconds. The cache has the model's dtype.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import engine.models.llama as llama  # noqa: E402
from benchmarks.engine_then_now import decode_steps  # noqa: E402
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from engine.hub import ensure_smollm2  # noqa: E402

CAN_PACK = llama._can_pack


def measure(dtype: str, pack: bool) -> dict[str, float]:
    llama._can_pack = CAN_PACK if pack else (lambda w: w.dtype == torch.float32 and CAN_PACK(w))
    engine = LLMEngine(EngineConfig(
        model=str(ensure_smollm2()), device="cpu", dtype=dtype, num_threads=2, seed=0,
        cache=CacheConfig(block_size=16, num_blocks=8 * 70 + 64),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
    rng = random.Random(0)

    decode_steps(engine, [[rng.randrange(100, 49152) for _ in range(32)]], 4)  # warm-up
    res = {}
    for batch, n in ((1, 16), (8, 16), (8, 1024)):
        prompts = [[rng.randrange(100, 49152) for _ in range(n)] for _ in range(batch)]
        decode_steps(engine, prompts, 1)
        res[f"b{batch}_ctx{n}"] = round(statistics.median(decode_steps(engine, prompts, 16)) * 1e3, 1)
    engine.add_request([rng.randrange(100, 49152) for _ in range(512)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()
    res["prefill_512"] = round((time.perf_counter() - t0) * 1e3, 1)
    return res


def main() -> None:
    for dtype, pack in (("float32", True), ("bfloat16", False), ("bfloat16", True),
                        ("bfloat16", True), ("bfloat16", False), ("float32", True)):
        print(dtype, "packed" if pack else "F.linear", measure(dtype, pack), flush=True)


if __name__ == "__main__":
    main()
