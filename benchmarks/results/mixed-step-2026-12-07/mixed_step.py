"""Is a colocated (mixed) step priced right by `planner.profile`'s rule, "the decode step of its rows +
the prefill terms of its prompt chunks"? Measures, on one engine with one thread (a worker's share, as
`pdserve plan profile` runs them): the decode step of B rows at context C alone, a prefill step of N fresh
prompt tokens alone, and the step that does both; several N to fit the prefill line (its intercept is the
fixed cost the rule leaves out, fitted in the profile's own form). Median of REPEATS each, interleaved.

    python benchmarks/results/mixed-step-2026-12-07/mixed_step.py
"""
from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPEATS = 7
CASES = [(4, 64), (4, 512), (8, 256)]  # (decode rows, their prompt tokens)
CHUNKS = (64, 256, 512)  # fresh prompt tokens computed in the step


def main() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(model="smollm2-135m", device="cpu", dtype="float32", num_threads=1,
                                    cache=CacheConfig(block_size=16, num_blocks=2048),
                                    scheduler=SchedulerConfig(64, 2048, True)))

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def timed_step() -> float:
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    def prefill_alone(n: int) -> float:
        r = engine.add_request(fresh(n), SamplingParams(max_tokens=1, temperature=0.0))
        dt = timed_step()
        assert r.is_finished, "the prompt took more than one step"
        return dt

    print(f"{'rows':>4} {'ctx':>4} {'chunk':>5} {'decode':>8} {'prefill':>8} {'mixed':>8} "
          f"{'sum-fixed':>9} {'mixed/rule':>10}", flush=True)
    for rows, ctx in CASES:
        decoders = [engine.add_request(fresh(ctx), SamplingParams(max_tokens=10_000, temperature=0.0,
                                                                   ignore_eos=True)) for _ in range(rows)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in decoders):
            engine.step()
        samples: dict[str, list[float]] = {}
        for _ in range(REPEATS):
            for n in CHUNKS:
                # decoders keep decoding through every step below; their context grows by a few tokens
                samples.setdefault("decode", []).append(timed_step())
                for r in decoders:
                    engine.pause(r.request_id)
                samples.setdefault(f"prefill{n}", []).append(prefill_alone(n))
                for r in decoders:
                    engine.resume(r.request_id)
                r = engine.add_request(fresh(n), SamplingParams(max_tokens=1, temperature=0.0))
                samples.setdefault(f"mixed{n}", []).append(timed_step())
                assert r.is_finished, "the prompt took more than one step"
        med = {k: statistics.median(v) for k, v in samples.items()}
        # a step's fixed cost: the profile's prefill form (fixed + token_s * n + attention_s * n^2 / 2,
        # a fresh prompt's attention pairs) through the three chunks alone. (A straight line through them
        # puts the fixed cost 30-40 ms lower: prefill is convex in n, and the rule would then look dear.)
        a = torch.tensor([[1.0, n, n * n / 2] for n in CHUNKS], dtype=torch.float64)
        y = torch.tensor([med[f"prefill{n}"] for n in CHUNKS], dtype=torch.float64)
        fixed = float(torch.linalg.solve(a, y)[0])
        print(f"{rows:>4} {ctx:>4}   fixed cost of a step (fitted): {fixed * 1e3:.1f} ms", flush=True)
        for n in CHUNKS:
            rule = med["decode"] + med[f"prefill{n}"] - fixed
            print(f"{rows:>4} {ctx:>4} {n:>5} {med['decode'] * 1e3:>7.1f}  {med[f'prefill{n}'] * 1e3:>7.1f}  "
                  f"{med[f'mixed{n}'] * 1e3:>7.1f}  {rule * 1e3:>8.1f}  {med[f'mixed{n}'] / rule:>9.2f}x",
                  flush=True)
        for r in decoders:
            engine.abort_request(r.request_id)
        while engine.has_unfinished_requests():
            engine.step()
    print(f"(torch {torch.__version__}, 1 thread; fixed cost per case from chunks {CHUNKS})", file=sys.stderr)


if __name__ == "__main__":
    main()
