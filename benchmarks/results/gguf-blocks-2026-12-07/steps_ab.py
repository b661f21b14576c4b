"""Ad hoc (kept with its output, steps_ab.txt): decode steps at batch 1/8/32 and 16/1,024 tokens of context,
and prefill steps, for SmolLM2's float32 matrices and its GGUF blocks, in one process, each case in the order
dense, GGUF, GGUF, dense (`engine_bench`'s context-case method: prompts prefilled into the prefix cache,
then the median step among 16 in which every sequence decodes; prefill: one prompt's step).

    python benchmarks/results/gguf-blocks-2026-12-07/steps_ab.py > steps_ab.txt
"""
import dataclasses
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import engine_bench as eb  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

torch.set_num_threads(2)
cfg = eb.BenchConfig(threads=2, context_lens=(16, 1024), context_batches=(1, 8, 32), quantization="none")
E = {"none": eb.load_context_engine(cfg)}
E["gguf"] = LLMEngine(dataclasses.replace(E["none"].config, quantization="gguf"))
assert E["gguf"].model.quantized and not E["none"].model.quantized
rng = random.Random(0)
out = {}
for batch, n in eb.context_cases(cfg):
    prompts = [eb.random_prompt(rng, n, 49152) for _ in range(batch)]
    row = {}
    for name in ["none", "gguf", "gguf", "none"]:
        eb.engine_prefill_into_cache(E[name], prompts)
        t = eb.engine_decode_step(E[name], prompts, 16) * 1e3
        row.setdefault(name, []).append(round(t, 1))
    out[f"b{batch}_ctx{n}"] = row
    print(batch, n, row, f"{min(row['none'])/min(row['gguf']):.2f}x", flush=True)
for n in (128, 512):
    row = {}
    for name in ["none", "gguf", "gguf", "none"]:
        p = eb.random_prompt(rng, n, 49152)
        row.setdefault(name, []).append(round(eb.engine_prefill(E[name], p) * 1e3, 1))
    print("prefill", n, row, f"{min(row['none'])/min(row['gguf']):.2f}x", flush=True)
