"""A prefill over vLLM's tensor-parallel ranks: its step against the read-back that ships its KV (the cost of
reading the ranks' KV into the worker after the step, `engine.vllm_ranks`), and against one rank.

A random Qwen3 of SmolLM2-135M's size but with heads that split in two (transformers-built, no download),
prompts of 128-2,048 tokens, prefill-only requests as a prefill worker runs them; each size in its own
process (vLLM allows one engine per process). Needs vLLM (docs/vllm_backend.md).

    python benchmarks/vllm_tp_prefill.py OUT_DIR [--tp 1 2] [--threads N]
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

PROMPT_TOKENS = (128, 512, 2048)


def build_model(root: Path) -> Path:
    import shutil

    import torch
    import transformers

    from engine.hub import resolve_model

    out = root / "qwen3-135m-shape"
    if (out / "config.json").exists():
        return out
    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2-135m") / name, out / name)
    return out


def measure(model: Path, tp: int, threads: int, repeats: int) -> dict:
    from engine.backend import create_engine
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams

    engine = create_engine(EngineConfig(model=str(model), backend="vllm", tensor_parallel_size=tp,
                                        num_threads=threads, max_model_len=4096,
                                        cache=CacheConfig(128, num_blocks=256),
                                        scheduler=SchedulerConfig(8, 4096, enable_prefix_caching=False)))
    rows = {}
    for n in PROMPT_TOKENS:
        steps, reads = [], []
        for r in range(repeats + 1):
            rid = f"p{n}-{r}"
            req = engine.make_request(rid, [100 + (i * 7 + r) % 40000 for i in range(n)],
                                      SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
            engine.enqueue(req)
            t0 = time.perf_counter()
            engine.step()
            step = time.perf_counter() - t0
            read = 0.0
            if engine._ranks is not None:  # what `_ship_from_ranks` reads after the step, timed alone
                t1 = time.perf_counter()
                engine._ranks.read(req.block_ids)
                read = time.perf_counter() - t1
            engine.abort_request(rid)
            while engine.has_scheduled_work():
                engine.step()
            if r:  # the first of each size warms up
                steps.append(step * 1e3)
                reads.append(read * 1e3)
        rows[n] = {"step_ms": statistics.median(steps), "read_back_ms": statistics.median(reads)}
        print(f"tp={tp} threads={threads} prompt={n}: step {rows[n]['step_ms']:.1f} ms, "
              f"read-back {rows[n]['read_back_ms']:.1f} ms", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=None, help="per rank; default: the cores / ranks")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = Path(tempfile.gettempdir()) / "pdserve-bench-models"  # (random weights: not worth keeping)
    model = build_model(models) if args.child is None else models / "qwen3-135m-shape"
    if args.child is not None:
        import os

        threads = args.threads or max(1, (os.cpu_count() or 1) // args.child)
        rows = measure(model, args.child, threads, args.repeats)
        (args.out / f"tp{args.child}.json").write_text(json.dumps({"tp": args.child, "threads": threads,
                                                                   "rows": rows}, indent=1))
        return
    for tp in args.tp:  # one process each: one vLLM engine per process
        cmd = [sys.executable, __file__, str(args.out), "--child", str(tp), "--repeats", str(args.repeats)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        subprocess.run(cmd, check=True)
    results = {tp: json.loads((args.out / f"tp{tp}.json").read_text()) for tp in args.tp}
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
