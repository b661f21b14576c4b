"""Draft-length policies of n-gram speculation, side by side in one run (issue #16).

    python -m benchmarks.spec_draft_bench                 # the table (about 4 minutes on 2 cores)
    python -m benchmarks.spec_draft_bench --json --out r.json
    python -m benchmarks.spec_draft_bench --quick         # a smoke run on tiny-random

One plain engine and one speculating engine per policy share the weights' checkpoint and the process. Each
workload (the engine bench's *repetition* and *chat* prompts, through the chat template) runs at batch 1
and batch 8, several rotations of the prompts; within a rotation every engine generates the same greedy
tokens (asserted), and each step goes to the engine that has spent least time so far, so all see the same
load. Decode throughput counts the steps in which every sequence decodes. A policy's ratio is its decode
tokens/s over the plain engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Sequence

import torch

from benchmarks.engine_bench import CHAT, REPETITION, DecodeRun, progress, random_prompt, run_paired
from benchmarks.output import emit
from engine import LLMEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

# name -> (k, max_draft_tokens_per_step)
POLICIES = {
    "k4": (4, 0),  # the default before 2026-12-01
    "k8-cap32": (8, 32),  # the default now: 8 drafts at batch 1, an equal share of 32 in a bigger batch
    "k8": (8, 0),
}


@dataclasses.dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    threads: int = 2
    batches: tuple[int, ...] = (1, 8)
    new_tokens: int = 128
    rotations: int = 3


QUICK = Config(model="tiny-random", batches=(1, 2), new_tokens=16, rotations=1)


def load(cfg: Config, speculative: SpeculativeConfig) -> LLMEngine:
    return LLMEngine(EngineConfig(model=cfg.model, device="cpu", dtype="float32", num_threads=cfg.threads,
                                  cache=CacheConfig(16, 2048), scheduler=SchedulerConfig(64, 2048),
                                  speculative=speculative))


def run(cfg: Config, policies: Sequence[str]) -> dict:
    torch.set_num_threads(cfg.threads)
    progress(f"loading {cfg.model} for the plain engine and {len(policies)} speculating ones")
    plain = load(cfg, SpeculativeConfig())
    engines = {name: load(cfg, SpeculativeConfig("ngram", *POLICIES[name])) for name in policies}
    rng = random.Random(0)
    vocab = plain.model.config.vocab_size
    run_paired([DecodeRun(e, [random_prompt(rng, 40, vocab)], 4) for e in (plain, *engines.values())])  # warm
    results: dict[str, dict] = {}
    for workload, texts in (("repetition", REPETITION), ("chat", CHAT)):
        prompts = [plain.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        for batch in cfg.batches:
            totals = {name: [0, 0.0] for name in ("plain", *engines)}  # decode tokens, seconds
            for rot in range(cfg.rotations):
                ps = [prompts[(i + rot) % len(prompts)] for i in range(batch)]
                for e in (plain, *engines.values()):
                    e.allocator.reset_cache()
                runs = {"plain": DecodeRun(plain, ps, cfg.new_tokens),
                        **{name: DecodeRun(e, ps, cfg.new_tokens) for name, e in engines.items()}}
                run_paired(list(runs.values()))
                for name, r in runs.items():
                    assert r.outputs == runs["plain"].outputs, f"{name} changed the greedy output"
                    totals[name][0] += r.tokens
                    totals[name][1] += r.seconds
            base = totals["plain"][0] / totals["plain"][1]
            row = {"plain_tok_s": base, **{name: t[0] / t[1] / base for name, t in totals.items() if name != "plain"}}
            results[f"{workload}_b{batch}"] = row
            progress(f"{workload}, batch {batch}: plain {base:.1f} tok/s, "
                     + ", ".join(f"{name} {row[name]:.2f}x" for name in engines))
    return {"model": cfg.model, "threads": cfg.threads, "torch": torch.__version__,
            "config": dataclasses.asdict(cfg), "policies": {n: POLICIES[n] for n in policies}, "results": results}


def table(summary: dict) -> str:
    names = list(summary["policies"])
    lines = ["workload          plain tok/s  " + "  ".join(f"{n:>9}" for n in names)]
    for key, row in summary["results"].items():
        lines.append(f"{key:<16}  {row['plain_tok_s']:>11.1f}  " + "  ".join(f"{row[n]:>8.2f}x" for n in names))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run on tiny-random")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", help="also write the JSON summary to this file")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)} (default: all)")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        sys.exit(f"--policies: unknown {unknown or 'empty list'}; choose from {', '.join(POLICIES)}")
    emit(run(QUICK if args.quick else Config(), policies), args.out, args.json, table)


if __name__ == "__main__":
    main()
