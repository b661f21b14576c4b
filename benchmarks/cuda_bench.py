"""Decode on a GPU: this engine against transformers `generate`, side by side, on a random model of SmolLM2's
shape (the GGUF checkpoint cannot travel to a device machine; speed does not depend on the weights' values).

For a session lent a device (see `benchmarks/device_check.sh`); also runs on CPU (`--device cpu`) as a smoke
test. Reports per batch size the median decode step of each side and their ratio, and the batch-1 step
against the device's copy roofline (every weight read once per step).

    python -m benchmarks.cuda_bench [--device cuda] [--dtype bfloat16] [--batches 1 8 32] [--json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, LogitsProcessorList

from benchmarks.engine_bench import (
    StepClock,
    copy_bandwidth,
    decode_bytes,
    engine_decode_step,
    progress,
    random_prompt,
)
from benchmarks.output import emit
from engine.checkpoint import byte_tokenizer, random_state_dict, write_checkpoint
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, cdiv
from engine.hub import TINY_RANDOM_CONFIG
from engine.llm_engine import LLMEngine

# SmolLM2-135M's shape (its GGUF's metadata)
SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                            num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                            tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
SHAPES = {"smollm2": SMOLLM2_SHAPE, "tiny": TINY_RANDOM_CONFIG}  # tiny: for the smoke test
BLOCK = 16


def hf_decode_step(hf: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Median seconds of one HF decode step, the prompts of equal length (no padding needed)."""
    clock = StepClock(device)
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          logits_processor=LogitsProcessorList([clock]), eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path, shape = Path(tmp) / "model", SHAPES[args.shape]
        progress(f"writing a random model of {args.shape}'s shape")
        write_checkpoint(path, shape, random_state_dict(shape, seed=0), byte_tokenizer(""))
        ctx = args.prompt_len + args.tokens
        engine = LLMEngine(EngineConfig(
            model=str(path), device=args.device, dtype=args.dtype, max_model_len=ctx + BLOCK,
            cache=CacheConfig(block_size=BLOCK, num_blocks=64 + max(args.batches) * cdiv(ctx, BLOCK)),
            scheduler=SchedulerConfig(max_num_seqs=max(args.batches),
                                      max_num_batched_tokens=max(2048, max(args.batches) * args.prompt_len))))
        hf = LlamaForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).to(device).eval()
    rng = random.Random(0)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "shape": args.shape, "dtype": args.dtype, "torch": torch.__version__, "decode": {}}
    for batch in args.batches:
        prompts = [random_prompt(rng, args.prompt_len, shape.vocab_size) for _ in range(batch)]
        engine_decode_step(engine, prompts[:1], 4)  # warm-up: kernels chosen, memory pools grown
        hf_decode_step(hf, prompts[:1], 4, device)
        e = min(engine_decode_step(engine, prompts, args.tokens) for _ in range(args.reps))
        h = min(hf_decode_step(hf, prompts, args.tokens, device) for _ in range(args.reps))
        results["decode"][str(batch)] = {"engine_step_ms": e * 1e3, "hf_step_ms": h * 1e3, "engine_vs_hf": h / e}
        progress(f"decode batch {batch}: engine {e * 1e3:.2f} ms/step, transformers {h * 1e3:.2f} ms/step")
    bandwidth = copy_bandwidth(1 << 30, device=device)
    roofline = decode_bytes(engine.model) / bandwidth
    step = results["decode"].get("1", {}).get("engine_step_ms")
    results["roofline"] = {"copy_gb_s": bandwidth / 1e9, "step_ms": roofline * 1e3,
                           "decode_b1_vs_roofline": roofline * 1e3 / step if step else None}
    return results


def table(r: dict) -> str:
    rows = [f"{r['device']}, {r['dtype']}, torch {r['torch']}; a random model of {r['shape']}'s shape",
            f"{'':16}{'engine':>10}{'transformers':>14}{'ratio':>9}"]
    for batch, d in r["decode"].items():
        rows.append(f"{'decode batch ' + batch:16}{d['engine_step_ms']:>8.2f}ms{d['hf_step_ms']:>12.2f}ms"
                    f"{d['engine_vs_hf']:>8.2f}x")
    f = r["roofline"]
    rows.append(f"roofline: {f['copy_gb_s']:.0f} GB/s copy = {f['step_ms']:.3f} ms per step"
                + (f"; engine batch 1 at {f['decode_b1_vs_roofline']:.2f} of it" if f["decode_b1_vs_roofline"] else ""))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timed run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here (use --device cpu for a smoke run)")
    emit(run(args), args.out, args.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
