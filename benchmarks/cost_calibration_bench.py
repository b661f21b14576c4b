"""Does the cost model learn what placement prices? Its two prefill measurements against what they stand for,
side by side in one run on one engine (issue #15).

    python -m benchmarks.cost_calibration_bench            # the table (about a minute on 2 cores)
    python -m benchmarks.cost_calibration_bench --json --out r.json
    python -m benchmarks.cost_calibration_bench --quick    # a smoke run on tiny-random

1. **A prefill worker's rate.** A burst of prompts (long and short) computed in fair order, 256 tokens per
   step, as a prefill worker runs them. The truth is the worker's throughput: every prompt token over every
   step's time. Each prompt yields one observation, measured two ways: its uncached tokens over the wall
   time from its first chunk to its first token (`wall`, the rule before 2026-12-01), and over its share of
   the steps that computed it (`compute`, `FirstToken.compute_s`); each rule's observations go through a
   `CostModel` in the order the first tokens came, and its rate is compared. A prompt that shares its steps
   with others took less of the worker than its wall time says, so `wall` rates the worker slower than it
   is and placement overprices its queue.
2. **A local prefill on a decode worker.** `batch` sequences decode while one prompt is prefilled on the
   same engine in 64-token chunks riding their steps, as `--local-prefill` does. The truth is what placement
   estimates: the time from submitting the prompt to its first token. The estimate is the one
   `placement.choose_path` makes (the prompt at the worker's prefill rate + one decode step per chunk),
   from a rate learned the old way (tokens over submit-to-first-token time, which already contains those
   steps) and the new way (each chunk's tokens over what it added to the fitted decode step,
   `CostModel.observe_step`).

Numbers are ratios to the truth: 1.0 is a calibrated model.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks.engine_bench import progress, random_prompt
from benchmarks.output import emit
from engine import LLMEngine, SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from router.cost_model import CostModel


@dataclasses.dataclass(frozen=True)
class Config:
    model: str = "smollm2-135m"
    threads: int = 2
    long_len: int = 768
    short_len: int = 48
    num_long: int = 3
    num_short: int = 6
    step_tokens: int = 256  # pdserve serve's --prefill-chunk-tokens
    batch: int = 4  # sequences decoding beside the local prefill
    local_len: int = 320
    local_chunk: int = 64  # pdserve serve's --decode-prefill-chunk-tokens
    reps: int = 3


QUICK = Config(model="tiny-random", long_len=256, short_len=40, num_long=2, num_short=2, step_tokens=64,
               local_len=128, local_chunk=32, reps=1)


def load(cfg: Config, chunk_tokens: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=cfg.model, device="cpu", dtype="float32", num_threads=cfg.threads,
        cache=CacheConfig(16, 1024),
        scheduler=SchedulerConfig(64, 4096, enable_prefix_caching=False, prefill_order="fair",
                                  prefill_chunk_tokens=chunk_tokens)))


def prefill_burst(cfg: Config, engine: LLMEngine, rng: random.Random) -> dict[str, float]:
    """One burst on a prefill engine: the worker's throughput and each prompt's two rate observations."""
    vocab = engine.model_config.vocab_size
    lens = [cfg.long_len] * cfg.num_long + [cfg.short_len] * cfg.num_short
    rng.shuffle(lens)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(random_prompt(rng, n, vocab), one) for n in lens]
    scheduled: dict[str, float] = {}
    sampled: dict[str, float] = {}
    busy = 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        out, advanced = engine.step()
        end = time.perf_counter()
        busy += end - start
        for c in out.chunks:
            scheduled.setdefault(c.request.request_id, start)
        for r in advanced:
            sampled[r.request_id] = end
    truth = sum(lens) / busy
    wall, compute = CostModel(bytes_per_token=1), CostModel(bytes_per_token=1)
    for r in sorted(reqs, key=lambda r: sampled[r.request_id]):  # in the order their first tokens came
        wall.observe_prefill("p", r.num_prompt_tokens, sampled[r.request_id] - scheduled[r.request_id])
        compute.observe_prefill("p", r.num_prompt_tokens, r.prefill_compute_s)
    return {"true_tok_s": truth, "wall": wall.prefill_rate("p") / truth,
            "compute": compute.prefill_rate("p") / truth}


def local_prefill(cfg: Config, engine: LLMEngine, rng: random.Random) -> dict[str, float]:
    """A prompt prefilled in chunks beside `batch` decoding sequences: its submit-to-first-token time, and
    the cost model's estimate of it from the rate each rule learns."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    decoding = [engine.add_request(random_prompt(rng, 32, vocab), params) for _ in range(cfg.batch)]
    new = CostModel(bytes_per_token=1)
    last = None
    while len(new.measured().decode_step_s) == 0 or sum(len(r.output_token_ids) for r in decoding) < 16 * cfg.batch:
        engine.step()  # their prompts, then decode steps: the fit at this batch
        now = time.perf_counter()
        st = engine.last_step
        if last is not None and not st.num_prefill_tokens:
            new.observe_step("d", now - last, st.num_decode_seqs)
        last = now
    submitted = time.perf_counter()
    prompt = engine.add_request(random_prompt(rng, cfg.local_len, vocab), SamplingParams(max_tokens=1))
    while not prompt.output_token_ids:
        engine.step()
        now = time.perf_counter()
        st = engine.last_step
        new.observe_step("d", now - last, st.num_decode_seqs, st.num_prefill_tokens)
        last = now
    actual = last - submitted
    for r in decoding:
        engine.abort_request(r.request_id)
    old = CostModel(bytes_per_token=1)
    old.observe_prefill("d", cfg.local_len, actual)  # submit -> first token, as the router did
    steps = -(-cfg.local_len // cfg.local_chunk)

    def estimate(cost: CostModel) -> float:  # as placement.choose_path prices the local path
        return cost.prefill_s("d", 0, cfg.local_len) + steps * new.step_time("d", cfg.batch + 1)

    return {"actual_s": actual, "wall": estimate(old) / actual, "compute": estimate(new) / actual}


def run(cfg: Config) -> dict:
    torch.set_num_threads(cfg.threads)
    progress(f"loading {cfg.model} twice: a prefill engine ({cfg.step_tokens} tokens a step) and a decode "
             f"engine ({cfg.local_chunk}-token local chunks)")
    prefill, decode = load(cfg, cfg.step_tokens), load(cfg, cfg.local_chunk)
    rng = random.Random(0)
    prefill_burst(cfg, prefill, rng)  # warm-up, both engines
    local_prefill(cfg, decode, rng)
    bursts, locals_ = [], []
    for i in range(cfg.reps):
        bursts.append(prefill_burst(cfg, prefill, rng))
        locals_.append(local_prefill(cfg, decode, rng))
        progress(f"rep {i + 1}/{cfg.reps}: prefill rate wall {bursts[-1]['wall']:.2f}x, compute "
                 f"{bursts[-1]['compute']:.2f}x of the truth; local estimate wall {locals_[-1]['wall']:.2f}x, "
                 f"compute {locals_[-1]['compute']:.2f}x")

    def med(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    return {"config": dataclasses.asdict(cfg), "prefill_rate": med(bursts), "local_estimate": med(locals_)}


def table(r: dict) -> str:
    p, d = r["prefill_rate"], r["local_estimate"]
    c = r["config"]
    return "\n".join([
        "| measured as | prefill worker's rate / its throughput | local prefill's estimate / its time |",
        "|---|---:|---:|",
        f"| wall time (before) | {p['wall']:.2f} | {d['wall']:.2f} |",
        f"| compute share (now) | {p['compute']:.2f} | {d['compute']:.2f} |",
        "",
        f"(prefill: {c['num_long']} x {c['long_len']} + {c['num_short']} x {c['short_len']} tokens at once, "
        f"{c['step_tokens']} a step, throughput {p['true_tok_s']:.0f} tokens/s; local: {c['local_len']} tokens "
        f"in {c['local_chunk']}-token chunks beside {c['batch']} decoding sequences, {d['actual_s']:.2f} s; "
        f"medians of {c['reps']})",
    ])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run on tiny-random")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--out", help="also write the summary to this JSON file")
    args = ap.parse_args(argv)
    emit(run(QUICK if args.quick else Config()), args.out, args.json, table)


if __name__ == "__main__":
    main(sys.argv[1:])
