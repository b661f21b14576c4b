"""What a built-in worker's engine spends its start on, each part the old way and the new, side by side.

    python -m benchmarks.worker_start                     # 2 rounds, SmolLM2 from its GGUF blocks
    python -m benchmarks.worker_start --rounds 3 --json OUT.json

Every measurement is a fresh Python process (1 torch thread, as a worker of a 2-core machine runs), so
imports and first touches of memory count as they do in a worker, and the two ways of each part alternate
A B B A over the rounds, so that the machine's drift falls on both alike:

- `gguf_metadata`: `gguf.GGUFReader` over SmolLM2's file against `engine.model_files.gguf_reader` (the same
  reader over plain views of its map);
- `eos_id`: the tokenizer loaded to ask its EOS id (what the engine did) against
  `engine.tokenizer.eos_token_id` (its JSON files; the worker never loads the tokenizer now);
- `kv_cache`: a float32 cache of `--blocks` SmolLM2 blocks, zeroed over 4 KB pages (`torch.zeros`) against
  `engine.kv_cache.huge_page_zeros` (2 MB pages, faster to read, slower to fault in);
- `engine`: `engine.LLMEngine` whole, the default cache sizing (a share of free memory) against 512 blocks
  (what the test suite's deployments take).

The figure of each is its median over the rounds, in seconds; the ratio old/new is the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETUP = """
import sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from engine.hub import ensure_smollm2, smollm2_gguf_path
hf, gguf = ensure_smollm2(), smollm2_gguf_path()
t0 = time.perf_counter()
"""

PARTS = {
    "gguf_metadata": ("from gguf import GGUFReader; GGUFReader(gguf)",
                      "from engine.model_files import gguf_reader; gguf_reader(gguf)"),
    "eos_id": ("from engine.tokenizer import Tokenizer; Tokenizer(hf).eos_token_id",
               "from engine.tokenizer import eos_token_id; eos_token_id(hf)"),
    "kv_cache": ("torch.zeros({shape}, dtype=torch.float32)",
                 "from engine.kv_cache import huge_page_zeros; huge_page_zeros({shape}, torch.float32)"),
    "engine": ("from engine.config import EngineConfig; from engine.llm_engine import LLMEngine; "
               "LLMEngine(EngineConfig(model='smollm2-135m', num_threads=1))",
               "from engine.config import EngineConfig; from engine.llm_engine import LLMEngine; "
               "from engine.config import CacheConfig; "
               "LLMEngine(EngineConfig(model='smollm2-135m', num_threads=1, "
               "cache=CacheConfig(num_blocks=512)))"),
}
LABELS = {"gguf_metadata": ("gguf.GGUFReader", "gguf_reader"), "eos_id": ("Tokenizer", "eos_token_id"),
          "kv_cache": ("4 KB pages", "2 MB pages"), "engine": ("default cache", "512 blocks")}


def timed(code: str) -> float:
    """Seconds `code` took in a fresh process, after the imports every part shares."""
    script = SETUP.format(root=str(ROOT)) + code + "\nprint(time.perf_counter() - t0)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=1474, help="KV blocks of the kv_cache part (a worker's here)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    shape = (30, 2, args.blocks, 16, 3, 64)  # SmolLM2: layers, K/V, blocks, tokens, KV heads, head dim
    results = {}
    for part in args.parts.split(","):
        old, new = (code.format(shape=shape) for code in PARTS[part])
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[which].append(timed(old if which == "old" else new))
                print(f"  {part} round {r + 1} {LABELS[part][which == 'new']}: {times[which][-1]:.2f} s",
                      file=sys.stderr, flush=True)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        results[part] = {"old": LABELS[part][0], "new": LABELS[part][1], "old_s": times["old"],
                         "new_s": times["new"], "ratio": o / n}
        print(f"{part:14s} {LABELS[part][0]:>16s} {o:6.2f} s   {LABELS[part][1]:>14s} {n:6.2f} s   {o / n:5.2f}x",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
