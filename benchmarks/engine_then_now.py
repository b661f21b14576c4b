"""The engine at a git ref against the working tree's, decoding at long contexts, side by side in one run.

    python -m benchmarks.engine_then_now                          # against bb212ee, issue #29's "today"
    python -m benchmarks.engine_then_now --ref HEAD~3 --cases 8x16,8x1024 --rounds 2 --json OUT.json
    python -m benchmarks.engine_then_now --gguf    # also the working tree over SmolLM2's GGUF blocks
    python -m benchmarks.engine_then_now --ref HEAD --ref-gguf --gguf   # two GGUF kernels, side by side

Issue #29 asks decode at batch 8 and 32 at 1,024 tokens of context to be at least 2x "today's", the engine
of the day it was filed (bb212ee, 2026-12-02 21:39). Its figure (280 ms at batch 8) was taken in a slow
hour on a machine that moves by 20% between hours, so a figure from another day proves nothing; this
script runs that engine and this one on the same machine in the same run instead. The ref's `engine/` and
`protocol/` are unpacked into a temporary directory (`git archive`), and each measurement is a fresh
Python process whose import path puts one tree first: then, now, now, then, ... (ABBA), so a drift of the
machine over the run falls on both alike.

In each process: SmolLM2-135M (the HF directory `engine.hub.ensure_smollm2` writes, float32, the same
files for both), a float32 cache of 16-token blocks, 2 torch threads; per case, `batch` random prompts of
exactly `context` tokens are prefilled into the prefix cache first, then run again with 16 new tokens
each, and the case's figure is the median step among the steps in which every sequence decoded one token
(as `engine_bench --sections context` measures it). The ratio then/now is the result; the milliseconds
move with the machine. `--gguf` adds a third process a round, the working tree serving the same model from
its GGUF file's Q4_1/Q8_0 blocks (`--quantization gguf`: the same float32 weight values, read in 5-8.5 bits a
weight), in the order then, now, now over GGUF, and reversed the next round.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ISSUE_29_FILED = "bb212ee"  # the last commit of 2026-12-02, when issue #29 measured "today"
TREES = ("engine", "protocol")  # what the engine imports of this repository
# this repository's top-level packages (pyproject's): a child must take every one it imports from its tree
PACKAGES = {"engine", "protocol", "router", "kv_transfer", "control", "planner", "protos", "prefill_worker",
            "decode_worker", "benchmarks"}
FIRST_PROMPT_ID = 100  # random prompt tokens stay clear of SmolLM2's special tokens (ids 0-16)
BLOCK_SIZE = 16
STEPS = 16
VOCAB = 49152  # SmolLM2's


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"8x16,8x1024" -> [(8, 16), (8, 1024)] (batch x tokens of context)."""
    cases = []
    for item in text.split(","):
        batch, _, context = item.strip().partition("x")
        if not (batch.isdigit() and context.isdigit() and int(batch) > 0 and int(context) > 0):
            raise argparse.ArgumentTypeError(f"--cases: {item!r} is not BATCHxCONTEXT, e.g. 8x1024")
        cases.append((int(batch), int(context)))
    return cases


# -- one measurement: runs in a child process, with one tree first on its import path ------------------------

def decode_steps(llm: Any, prompts: list[list[int]], tokens: int) -> list[float]:
    """Run `prompts` greedy for `tokens` new tokens each on `llm` (an `engine.LLMEngine`, of this tree or an
    older one: only what both have, `add_request`, `step` and its chunks); the seconds of each step in which
    every one of them decoded one token."""
    from engine import SamplingParams

    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    steps = []
    while llm.has_unfinished_requests():
        t0 = time.perf_counter()
        out, _ = llm.step()
        dt = time.perf_counter() - t0
        if len(out.chunks) == len(prompts) and all(c.num_tokens == 1 for c in out.chunks):
            steps.append(dt)
    return steps


def measure(model: str, cases: list[tuple[int, int]], threads: int, seed: int) -> dict:
    """Median ms per all-decoding step for each case, with whichever `engine` the import path finds."""
    from engine import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig

    blocks = max(b * -(-(n + STEPS + 1) // BLOCK_SIZE) for b, n in cases) + 64
    llm = LLMEngine(EngineConfig(
        model=model, device="cpu", dtype="float32", num_threads=threads, seed=seed,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)))
    rng = random.Random(seed)

    decode_steps(llm, [[rng.randrange(FIRST_PROMPT_ID, VOCAB) for _ in range(32)]], 4)  # warm-up
    results = {}
    for batch, n in cases:
        prompts = [[rng.randrange(FIRST_PROMPT_ID, VOCAB) for _ in range(n)] for _ in range(batch)]
        decode_steps(llm, prompts, 1)  # into the prefix cache: all then decode from the first step
        results[f"b{batch}_ctx{n}"] = statistics.median(decode_steps(llm, prompts, STEPS)) * 1e3
    # every module of this repository's packages the engine pulled in, with where it came from: an editable
    # install's finder maps packages the old tree lacks onto the working tree, which would mix the two
    ours = {m.__name__: m.__file__ for m in list(sys.modules.values())
            if m.__name__.split(".")[0] in PACKAGES and getattr(m, "__file__", None)}
    return {"modules": ours, "step_ms": results}


def child_main() -> None:
    args = json.loads(sys.argv[2])
    print(json.dumps(measure(**args)), flush=True)


# -- the parent ---------------------------------------------------------------------------------------------

def unpack(ref: str, into: Path) -> Path:
    """The ref's engine and protocol packages under `into` (a commit that lacks them is refused)."""
    commit = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=REPO, text=True,
                            capture_output=True)
    if commit.returncode:
        raise SystemExit(f"--ref {ref!r}: not a commit of {REPO} ({commit.stderr.strip()})")
    archive = subprocess.run(["git", "archive", ref, *TREES], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def one_process(tree: Path, args: dict, timeout_s: float) -> dict:
    from benchmarks.child import die_with_parent

    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout_s,
                          preexec_fn=functools.partial(die_with_parent, os.getpid()))
    if done.returncode:
        raise SystemExit(f"the engine under {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    root = tree.resolve()
    strays = {name: f for name, f in got["modules"].items() if not Path(f).resolve().is_relative_to(root)}
    if strays:
        raise SystemExit(f"the process under {tree} imported modules from elsewhere: {strays}")
    return got["step_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default=ISSUE_29_FILED, help="the commit to compare with (default: %(default)s)")
    ap.add_argument("--cases", type=parse_cases, default=parse_cases("8x16,8x1024,32x1024"),
                    help="BATCHxCONTEXT,... (default: 8x16,8x1024,32x1024)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each runs both trees (default: 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per process")
    ap.add_argument("--json", type=Path, help="write the runs and the ratios here")
    ap.add_argument("--gguf", action="store_true",
                    help="also run the working tree over SmolLM2's GGUF blocks (--quantization gguf)")
    ap.add_argument("--ref-gguf", action="store_true",
                    help="run the ref over SmolLM2's GGUF file as well (a ref with the GGUF kernel keeps its "
                         "blocks: two kernels side by side, e.g. --ref HEAD --ref-gguf --gguf)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")

    sys.path.insert(0, str(REPO))
    from engine.hub import ensure_smollm2, smollm2_gguf_path

    params = {"model": str(ensure_smollm2()), "cases": args.cases, "threads": args.threads, "seed": 0}
    # (a .gguf model is kept in its blocks by default)
    gguf_params = {**params, "model": str(smollm2_gguf_path())}
    with tempfile.TemporaryDirectory(prefix="pdserve-then-") as tmp:
        trees = {"then": unpack(args.ref, Path(tmp)), "now": REPO, "now_gguf": REPO}
        names = ["then", "now"] + (["now_gguf"] if args.gguf else [])
        runs: dict[str, list[dict]] = {name: [] for name in names}
        order = [name for r in range(args.rounds) for name in (names if r % 2 == 0 else names[::-1])]
        for i, name in enumerate(order, 1):
            which = {"then": f"at {args.ref}", "now": "of the working tree",
                     "now_gguf": "of the working tree over the GGUF blocks"}[name]
            progress(f"[{i}/{len(order)}] the engine {which}")
            t0 = time.perf_counter()
            gguf_run = name == "now_gguf" or (name == "then" and args.ref_gguf)
            got = one_process(trees[name], gguf_params if gguf_run else params, args.timeout_s)
            runs[name].append(got)
            progress("  " + ", ".join(f"{k} {v:.1f} ms/step" for k, v in got.items())
                     + f" ({time.perf_counter() - t0:.0f} s)")

    summary = {}
    gguf = "now_gguf" in runs
    print(f"{'case':<14}{'then ms':>10}{'now ms':>10}{'now faster':>12}"
          + (f"{'GGUF ms':>10}{'GGUF faster':>13}" if gguf else ""))
    for key in runs["now"][0]:
        then = statistics.median(r[key] for r in runs["then"])
        now = statistics.median(r[key] for r in runs["now"])
        summary[key] = {"then_step_ms": then, "now_step_ms": now, "speedup": then / now}
        line = f"{key:<14}{then:>10.1f}{now:>10.1f}{then / now:>11.2f}x"
        if gguf:
            blocks = statistics.median(r[key] for r in runs["now_gguf"])
            summary[key].update({"now_gguf_step_ms": blocks, "gguf_speedup": then / blocks})
            line += f"{blocks:>10.1f}{then / blocks:>12.2f}x"
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ref": args.ref, "cases": args.cases, "threads": args.threads,
                                         "order": order, "runs": runs, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main()
    else:
        main()
