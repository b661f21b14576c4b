"""The engine against transformers `generate` on CPU, side by side in one process (issue #2).

    python -m benchmarks.engine_bench            # the full run, a table (minutes; see below)
    python -m benchmarks.engine_bench --quick    # a smoke run with small sizes (under a minute)
    python -m benchmarks.engine_bench --json     # one JSON object on stdout instead of the table

--quick prefills 128 and 512 tokens only, so its `prefill_2048_vs_hf` is null.

Both sides run SmolLM2-135M in float32 from the same weights (transformers loads the HF directory that
`engine.hub.ensure_smollm2()` writes) with the same torch thread count, which `torch.set_num_threads` sets
for the whole process. Progress lines go to stderr.

Decisions, so the numbers can be argued with:

- Noise. The machine is shared, so absolute numbers drift with its load. Every measurement alternates
  engine and HF repetition by repetition and keeps each side's best; the ratios are the result. The load
  average before and after is printed. With 2 threads on 2 cores that other processes also use, every
  parallel op can wait a scheduler slice for its second thread: the full run takes about 6 minutes on
  an idle machine and several times that on a busy one (HF's mixed workload is most of it).
- Decode is timed per step, away from prefill. Engine: the wall time of `LLMEngine.step()` (schedule,
  model, sample, update) over the steps in which every sequence decodes. HF: the interval between two
  calls of a logits processor inside one `generate`, i.e. one forward plus the greedy pick. Each side
  reports its median step; tok/s = batch / step. Prompts are 32-64 random tokens, left padded with an
  attention mask for HF; EOS is ignored on both sides (`ignore_eos`, and HF's `eos_token_id` cleared).
- The mixed workload (64 requests, prompts 32-512, outputs 16-256 tokens, seeded): the engine gets all
  of them at once and batches continuously. HF's baseline is static batches of 8 requests in arrival
  order, left padded, each batch generating until its longest request is done; only the tokens each
  request asked for count. Why this baseline: `generate` has no continuous batching; arrival order is
  what a server sees (grouping by output length would need to know the lengths in advance); batch 8
  keeps padding and the run-to-the-longest waste moderate while still batching. `--hf-batch` changes it.
  Throughput is output tokens / time for the whole workload, prefill included. The sides take turns (an
  HF batch, then engine steps up to the same share of the output tokens), so both see the same load.
- Prefill: the engine runs one request with `max_tokens=1` as one step (its token budget is 2,048, so
  the prompt is never chunked); HF runs one forward with `logits_to_keep=1` (what `generate` does for
  its prefill), filling its KV cache. A fresh random prompt each repetition, so no prefix cache hits.
- Roofline: a batch-1 decode step must stream every layer matrix and norm, the final norm and lm_head
  (not the embedding table: one row of it). That many bytes divided by the measured copy bandwidth (a
  512 MB tensor copy, read plus write bytes per second) is the fastest a step can be; our batch-1 step,
  timed right after the bandwidth so both see the same load, is reported as a fraction of it.
- One engine serves all three workloads, with max_num_batched_tokens = 2,048 and max_num_seqs = 64.
- Speculation (`spec_ngram_*_vs_plain`): a second engine on the same weights with n-gram speculation on
  (k = 8 and the default per-step draft cap, n-grams of 4 down to 2) against the first, greedy, on the same prompts at the same time: each
  step goes to the side that has spent less time so far, so both see the same load. Two workloads of real text, each through SmolLM2's chat template: *repetition* (rewrite a code
  block with a small edit, quote or summarise from a long passage: output that copies from the prompt)
  and *chat* (open questions: little to copy). Decode throughput: output tokens of the steps in which
  every sequence decodes, over those steps' time (prefill steps left out on both sides); both engines
  produce the same tokens, which the run asserts. These requests stop at EOS.
- Context (`decode_bB_ctxN_*`, issue #29): decode at 16, 256, 1,024 and 4,096 tokens of context, batch 1,
  8 and 32 (batch x context at most 32,768). Each batch of random prompts is first prefilled into the
  prefix cache, so every engine run decodes all its sequences together from its first step. One engine
  runs each case with its paged-attention kernel, then with the kernel off (blocks gathered per layer,
  then SDPA: the path before the kernel), then HF decodes the same prompts; each reports its median step.
  With `--context-kv-cache-dtype bfloat16,fp8`, an engine over each of those caches (float32 weights)
  runs every case too (`kv_<dtype>_step_ms`, and its own step growth with context).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
import transformers
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from benchmarks.engine_then_now import decode_steps
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.config import FP8_KV_DTYPES, KV_CACHE_DTYPES, SpeculativeConfig, cdiv
from engine.hub import ensure_smollm2
from engine.models.llama import LlamaForCausalLM
from engine.quant import BlockQuantized
from engine.request import Request

MODEL = "smollm2-135m"
PAD_ID = 0
NARROW = tuple(d for d in KV_CACHE_DTYPES if d != "float32")  # the context section's other caches
FIRST_PROMPT_ID = 100  # random prompt tokens stay clear of SmolLM2's special tokens (ids 0-16)
BLOCK_SIZE = 16
COPY_BYTES = 512 * 2**20

Prompt = list[int]
T = TypeVar("T")


@dataclass(frozen=True)
class BenchConfig:
    threads: int = 2  # torch intra-op threads, for both sides
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_len: tuple[int, int] = (32, 64)  # varied, so HF's batch really is padded
    decode_tokens: int = 64  # new tokens per decode run
    decode_reps: int = 3
    mixed_requests: int = 64
    mixed_prompt_len: tuple[int, int] = (32, 512)
    mixed_output_len: tuple[int, int] = (16, 256)
    hf_batch: int = 8  # HF's static batch size in the mixed workload
    prefill_lens: tuple[int, ...] = (128, 512, 2048)
    prefill_reps: int = 3
    max_num_batched_tokens: int = 2048  # the engine's per-step token budget
    spec_batches: tuple[int, ...] = (1, 8)
    spec_tokens: int = 128  # new tokens per speculation run
    spec_reps: int = 2
    num_speculative_tokens: int = 8
    context_lens: tuple[int, ...] = (16, 256, 1024, 4096)  # decode at these contexts (tokens of prompt)
    context_batches: tuple[int, ...] = (1, 8, 32)
    context_max_tokens: int = 8 * 4096  # batch x context cap (HF prefills it in one padded batch)
    context_steps: int = 16  # decode steps per context run
    # also run each context case over KV caches of these dtypes (float32 weights), side by side ("bfloat16")
    context_kv_cache_dtypes: tuple[str, ...] = ()
    # the engine's weights (EngineConfig.quantization): None, SmolLM2's default (its GGUF blocks); "none":
    # the dequantised float32 matrices transformers reads
    quantization: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < max(self.prefill_lens):
            raise ValueError("BenchConfig.max_num_batched_tokens must cover the longest prefill "
                             f"({max(self.prefill_lens)}), got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < max(self.decode_batches) * self.decode_prompt_len[1]:
            raise ValueError("BenchConfig.max_num_batched_tokens must fit a whole decode batch's prompts")


REPETITION = [
    "Here is a passage:\n\nThe lighthouse stood at the edge of the cliff for two hundred years. Every night "
    "the keeper climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them "
    "again to put it out. Ships passed safely because of him, and none of their sailors ever knew his name.\n\n"
    "Quote the passage word for word.",
    "Add a docstring to the class and change nothing else:\n\n```python\nclass Stack:\n"
    "    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n    def is_empty(self):\n        return not self.items\n```",
    "Here is a paragraph:\n\nPaged attention stores the key and value cache in fixed-size blocks, so a sequence's "
    "cache need not be contiguous in memory. A block table maps each sequence's logical blocks to physical "
    "blocks, which lets the server share prefixes between requests and avoid fragmentation.\n\n"
    "Quote the paragraph word for word.",
    "Fix the typo in this code and print the whole corrected code:\n\n```python\ndef area(width, height):\n"
    "    return width * height\n\n\ndef perimeter(width, heigth):\n    return 2 * (width + height)\n\n\n"
    "def describe(width, height):\n    print('area', area(width, height))\n"
    "    print('perimeter', perimeter(width, height))\n```",
    "Here is a quote:\n\nIt was the best of times, it was the worst of times, it was the age of wisdom, it was "
    "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.\n\n"
    "Repeat the quote exactly.",
    "Rename the function `f` to `square` in this code and print the whole code:\n\n```python\n"
    "def f(x):\n    return x * x\n\n\nvalues = [1, 2, 3, 4]\nsquares = [f(v) for v in values]\n"
    "print(squares)\n```",
    "Here is a note:\n\nThe meeting is moved to Thursday at ten in the small room on the third floor. Please "
    "bring the quarterly figures and the draft of the new budget, and tell Anna that the printer is fixed.\n\n"
    "Quote the note word for word.",
    "Add type hints to this function and print the whole function:\n\n```python\ndef greet(name, times):\n"
    "    out = []\n    for i in range(times):\n        out.append('Hello, ' + name + '!')\n"
    "    return ' '.join(out)\n```",
]
CHAT = [
    "Write a haiku about the sea.",
    "Why is the sky blue? Explain briefly.",
    "Give me three ideas for a birthday party.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I make a good cup of tea?",
    "What are the benefits of regular exercise?",
    "Describe your ideal weekend.",
]


QUICK = BenchConfig(decode_batches=(1, 8), decode_tokens=16, decode_reps=2, mixed_requests=8,
                    mixed_prompt_len=(16, 128), mixed_output_len=(4, 24), prefill_lens=(128, 512),
                    prefill_reps=1, spec_tokens=48, spec_reps=1, context_lens=(16, 1024), context_batches=(1, 8))
SECTIONS = ("decode", "mixed", "prefill", "roofline", "spec", "context")


@dataclass(frozen=True)
class MixedRequest:
    prompt: Prompt
    max_tokens: int


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_prompt(rng: random.Random, length: int, vocab: int) -> Prompt:
    return [rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)]


def mixed_workload(cfg: BenchConfig, rng: random.Random, vocab: int) -> list[MixedRequest]:
    return [MixedRequest(random_prompt(rng, rng.randint(*cfg.mixed_prompt_len), vocab),
                         rng.randint(*cfg.mixed_output_len)) for _ in range(cfg.mixed_requests)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- loading ------------------------------------------------------------------------------------------------

def load_engine(cfg: BenchConfig, mixed: Sequence[MixedRequest]) -> LLMEngine:
    # enough blocks that nothing is ever preempted: the whole mixed workload resident at once
    num_blocks = 64 + max(
        sum(cdiv(len(r.prompt) + r.max_tokens, BLOCK_SIZE) for r in mixed),
        max(cfg.decode_batches) * cdiv(cfg.decode_prompt_len[1] + cfg.decode_tokens, BLOCK_SIZE),
        cdiv(max(cfg.prefill_lens) + 1, BLOCK_SIZE),
    )
    return LLMEngine(EngineConfig(
        model=MODEL, device="cpu", dtype="float32", num_threads=cfg.threads, seed=cfg.seed,
        quantization=cfg.quantization,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=cfg.max_num_batched_tokens),
    ))


def load_spec_engine(cfg: BenchConfig, like: LLMEngine) -> LLMEngine:
    """An engine like `like` with n-gram speculation on."""
    return LLMEngine(dataclasses.replace(like.config, speculative=SpeculativeConfig(
        "ngram", cfg.num_speculative_tokens)))


def load_hf() -> transformers.PreTrainedModel:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(ensure_smollm2()), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore EOS, like the engine's ignore_eos
    hf.generation_config.pad_token_id = PAD_ID
    return hf


# -- the engine -------------------------------------------------------------------------------------------

def engine_decode_step(engine: LLMEngine, prompts: Sequence[Prompt], new_tokens: int) -> float:
    """Median seconds of one engine step among the steps in which every sequence decodes."""
    return statistics.median(decode_steps(engine, list(prompts), new_tokens))


def engine_steps_until(engine: LLMEngine, handles: Sequence[Request], tokens: float) -> float:
    """Step until the requests hold `tokens` output tokens between them (or all are done); seconds spent."""
    spent = 0.0
    while engine.has_unfinished_requests() and sum(len(h.output_token_ids) for h in handles) < tokens:
        spent += timed(engine.step)
    return spent


def engine_prefill_into_cache(engine: LLMEngine, prompts: Sequence[Prompt]) -> None:
    """Prefill the prompts into the prefix cache, so that a later run of them decodes all of them together
    from its first step (chunked, a batch x context over the step budget would otherwise finish its first
    sequences before its last ones are prefilled)."""
    for p in prompts:
        engine.add_request(p, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()


def engine_prefill(engine: LLMEngine, prompt: Prompt) -> float:
    engine.add_request(prompt, greedy(1))
    t0 = time.perf_counter()
    out, _ = engine.step()
    dt = time.perf_counter() - t0
    assert out.num_tokens == len(prompt) and not engine.has_unfinished_requests(), "prefill was chunked"
    return dt


# -- transformers -----------------------------------------------------------------------------------------

CPU = torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA timing is otherwise of the launch, not of the work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(LogitsProcessor):
    """Timestamps every generation step: `generate` calls it once per step, right after the forward (on
    `device`, once the step's work there is done)."""

    def __init__(self, device: torch.device = CPU) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def left_pad(prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, both [batch, longest prompt]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate(hf: transformers.PreTrainedModel, prompts: Sequence[Prompt], new_tokens: int,
                clock: StepClock | None = None) -> None:
    ids, mask = left_pad(prompts)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          logits_processor=LogitsProcessorList([clock] if clock else []))
    assert out.shape[1] == ids.shape[1] + new_tokens, "HF stopped early: EOS was not ignored"


def hf_decode_step(hf: transformers.PreTrainedModel, prompts: Sequence[Prompt], new_tokens: int) -> float:
    clock = StepClock()
    hf_generate(hf, prompts, new_tokens, clock)
    return statistics.median(b - a for a, b in itertools.pairwise(clock.times))


def hf_prefill(hf: transformers.PreTrainedModel, prompt: Prompt) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return timed(lambda: hf(ids, logits_to_keep=1))


# -- the roofline -----------------------------------------------------------------------------------------

def copy_bandwidth(num_bytes: int = COPY_BYTES, reps: int = 5, device: torch.device = CPU) -> float:
    """Bytes per second of a large tensor copy on `device`, counting both the bytes read and the bytes
    written."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in

    def copy() -> None:
        dst.copy_(src)
        sync(device)

    sync(device)
    return 2 * num_bytes / min(timed(copy) for _ in range(reps))


def decode_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a batch-1 decode step streams: all layer weights, the final norm, lm_head, one embedding row."""
    e = model.embed
    table = e.nbytes if isinstance(e, BlockQuantized) else e.numel() * e.element_size()
    return model.weight_bytes - table + table // e.shape[0]


# -- the run ----------------------------------------------------------------------------------------------

def best_of(inputs: Sequence[T], engine_fn: Callable[[T], float],
            hf_fn: Callable[[T], float]) -> tuple[float, float]:
    """Each side's fastest run, one run per input, the sides alternating so they see the same load."""
    engine_t, hf_t = [], []
    for x in inputs:
        engine_t.append(engine_fn(x))
        hf_t.append(hf_fn(x))
    return min(engine_t), min(hf_t)


def bench_decode(cfg: BenchConfig, engine: LLMEngine, hf: transformers.PreTrainedModel,
                 rng: random.Random, vocab: int) -> dict[str, dict[str, float]]:
    results = {}
    n = cfg.decode_tokens
    for batch in cfg.decode_batches:
        prompts = [random_prompt(rng, rng.randint(*cfg.decode_prompt_len), vocab) for _ in range(batch)]
        e, h = best_of([prompts] * cfg.decode_reps, lambda p: engine_decode_step(engine, p, n),
                       lambda p: hf_decode_step(hf, p, n))
        results[str(batch)] = {"engine_step_ms": e * 1e3, "hf_step_ms": h * 1e3,
                               "engine_tok_s": batch / e, "hf_tok_s": batch / h}
        progress(f"decode batch {batch}: engine {e * 1e3:.1f} ms/step, HF {h * 1e3:.1f} ms/step")
    return results


def bench_mixed(cfg: BenchConfig, engine: LLMEngine, hf: transformers.PreTrainedModel,
                reqs: Sequence[MixedRequest]) -> dict[str, float]:
    """The two sides take turns, so both see the same machine load: one HF static batch, then engine
    steps until the engine has produced the same share of the workload's output tokens."""
    tokens = sum(r.max_tokens for r in reqs)
    batches = [reqs[i:i + cfg.hf_batch] for i in range(0, len(reqs), cfg.hf_batch)]
    progress(f"mixed: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, {tokens} "
             f"output tokens; HF in {len(batches)} static batches, the engine in step with it")
    engine.allocator.reset_cache()
    t0 = time.perf_counter()
    handles = [engine.add_request(r.prompt, greedy(r.max_tokens)) for r in reqs]
    engine_s, hf_s = time.perf_counter() - t0, 0.0
    for i, batch in enumerate(batches, 1):
        hf_s += timed(partial(hf_generate, hf, [r.prompt for r in batch], max(r.max_tokens for r in batch)))
        engine_s += engine_steps_until(engine, handles, tokens * i / len(batches))
        progress(f"mixed: {i}/{len(batches)} done, engine {engine_s:.1f}s, HF {hf_s:.1f}s")
    assert all(len(h.output_token_ids) == r.max_tokens for h, r in zip(handles, reqs))
    return {"requests": len(reqs), "output_tokens": tokens, "hf_batch": cfg.hf_batch,
            "engine_s": engine_s, "hf_s": hf_s, "engine_tok_s": tokens / engine_s, "hf_tok_s": tokens / hf_s}


def bench_prefill(cfg: BenchConfig, engine: LLMEngine, hf: transformers.PreTrainedModel,
                  rng: random.Random, vocab: int) -> dict[str, dict[str, float]]:
    results = {}
    for n in cfg.prefill_lens:
        # a fresh prompt each repetition, so the engine's prefix cache never hits
        prompts = [random_prompt(rng, n, vocab) for _ in range(cfg.prefill_reps)]
        e, h = best_of(prompts, lambda p: engine_prefill(engine, p), lambda p: hf_prefill(hf, p))
        results[str(n)] = {"engine_ms": e * 1e3, "hf_ms": h * 1e3, "engine_tok_s": n / e, "hf_tok_s": n / h}
        progress(f"prefill {n}: engine {e * 1e3:.0f} ms, HF {h * 1e3:.0f} ms")
    return results


def matmul_pass(model: LlamaForCausalLM, reps: int = 5) -> float:
    """Seconds of a batch-1 step's matrix multiplies alone (every layer's and lm_head, nothing else), best
    of `reps`: what the step would cost with every other op free."""
    c = model.config
    x, q, i = torch.zeros(1, c.hidden_size), torch.zeros(1, c.q_size), torch.zeros(1, c.intermediate_size)

    def once() -> None:
        for layer in model.layers:
            layer.qkv(x), layer.o(q), layer.gate(x), layer.up(x), layer.down(i)
        model.lm_head(x)

    with torch.inference_mode():
        return min(timed(once) for _ in range(reps))


def bench_roofline(cfg: BenchConfig, engine: LLMEngine, rng: random.Random, vocab: int) -> dict[str, float]:
    """The copy bandwidth, the engine's batch-1 step and its matmuls alone, measured back to back so all
    see the same load; the median of `decode_reps` such triples."""
    nbytes = decode_bytes(engine.model)
    prompt = random_prompt(rng, cfg.decode_prompt_len[1], vocab)
    triples = [(copy_bandwidth(), engine_decode_step(engine, [prompt], cfg.decode_tokens),
                matmul_pass(engine.model)) for _ in range(cfg.decode_reps)]
    bandwidth, engine_step, matmuls = sorted(triples, key=lambda p: p[0] * p[1])[len(triples) // 2]
    step = nbytes / bandwidth
    progress(f"roofline: {nbytes / 1e6:.1f} MB per step / {bandwidth / 1e9:.1f} GB/s = {step * 1e3:.1f} ms; "
             f"engine batch 1 {engine_step * 1e3:.1f} ms/step beside it, its matmuls alone {matmuls * 1e3:.1f} ms")
    return {"bytes_per_step": nbytes, "copy_gb_s": bandwidth / 1e9, "step_ms": step * 1e3,
            "tok_s": 1 / step, "engine_step_ms": engine_step * 1e3, "engine_fraction": step / engine_step,
            "matmuls_ms": matmuls * 1e3, "matmuls_fraction": step / matmuls}


class DecodeRun:
    """One engine generating for a batch of prompts, a step at a time: the decode tokens (appended in
    steps without a prefill chunk) and those steps' seconds."""

    def __init__(self, engine: LLMEngine, prompts: Sequence[Prompt], new_tokens: int) -> None:
        self.engine = engine
        # NOTE: EOS ends a request here (unlike the other workloads): past it SmolLM2 invents new chat
        # turns, which is neither the workload nor what a server would stream
        self.reqs = [engine.add_request(p, SamplingParams(max_tokens=new_tokens, temperature=0.0))
                     for p in prompts]
        self.elapsed = 0.0  # every step's time, prefill included
        self.tokens, self.seconds = 0, 0.0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    @property
    def outputs(self) -> list[list[int]]:
        return [r.output_token_ids for r in self.reqs]

    def step(self) -> None:
        before = sum(len(r.output_token_ids) for r in self.reqs)
        t0 = time.perf_counter()
        out, _ = self.engine.step()
        dt = time.perf_counter() - t0
        self.elapsed += dt
        if all(c.start >= c.request.num_prompt_tokens for c in out.chunks):
            self.tokens += sum(len(r.output_token_ids) for r in self.reqs) - before
            self.seconds += dt


def run_paired(runs: Sequence[DecodeRun]) -> None:
    """Step the runs to completion, always the one that has spent least time so far, so that they share
    the machine's load over the same stretch of time (a shared machine's load drifts by the second)."""
    while not all(r.done for r in runs):
        min((r for r in runs if not r.done), key=lambda r: r.elapsed).step()


def bench_spec(cfg: BenchConfig, engine: LLMEngine, spec: LLMEngine) -> dict[str, dict[str, float]]:
    """Speculating vs plain engine, per workload and batch: decode tokens/s over all repetitions (each
    a different rotation of the prompts, both sides run paired) and how many tokens each speculating
    sequence-step appended."""
    results = {}
    for name, texts in (("repetition", REPETITION), ("chat", CHAT)):
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        for batch in cfg.spec_batches:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            plain, fast = [0, 0.0], [0, 0.0]  # tokens, seconds
            before = spec.scheduler.spec_stats
            for rep in range(cfg.spec_reps):
                ps = [batch_prompts[(i + rep) % batch] for i in range(batch)] if batch > 1 else [prompts[rep]]
                engine.allocator.reset_cache()
                spec.allocator.reset_cache()
                runs = [DecodeRun(engine, ps, cfg.spec_tokens), DecodeRun(spec, ps, cfg.spec_tokens)]
                run_paired(runs)
                assert runs[1].outputs == runs[0].outputs, "speculation changed the greedy output"
                plain = [plain[0] + runs[0].tokens, plain[1] + runs[0].seconds]
                fast = [fast[0] + runs[1].tokens, fast[1] + runs[1].seconds]
            st = spec.scheduler.spec_stats
            drafts = st.num_draft_tokens - before.num_draft_tokens
            accepted = st.num_accepted_tokens - before.num_accepted_tokens
            steps = st.num_decode_seq_steps - before.num_decode_seq_steps
            tokens = st.num_decode_tokens - before.num_decode_tokens
            r = {"plain_tok_s": plain[0] / plain[1], "spec_tok_s": fast[0] / fast[1],
                 "ratio": fast[0] / fast[1] / (plain[0] / plain[1]),
                 "acceptance": accepted / drafts if drafts else 0.0, "tokens_per_step": tokens / steps}
            results[f"{name}_b{batch}"] = r
            progress(f"speculation, {name}, batch {batch}: plain {r['plain_tok_s']:.1f} tok/s, ngram "
                     f"{r['spec_tok_s']:.1f} tok/s ({r['ratio']:.2f}x), acceptance {r['acceptance']:.2f}, "
                     f"{r['tokens_per_step']:.2f} tokens/step")
    return results


def context_cases(cfg: BenchConfig) -> list[tuple[int, int]]:
    return [(b, n) for n in cfg.context_lens for b in cfg.context_batches if b * n <= cfg.context_max_tokens]


def load_context_engine(cfg: BenchConfig, kv_cache_dtype: str | None = None) -> LLMEngine:
    blocks = max(b * cdiv(n + cfg.context_steps + 1, BLOCK_SIZE) for b, n in context_cases(cfg))
    return LLMEngine(EngineConfig(
        model=MODEL, device="cpu", dtype="float32", num_threads=cfg.threads, seed=cfg.seed,
        quantization=cfg.quantization,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks + 64, dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=cfg.max_num_batched_tokens),
    ))


def bench_context(cfg: BenchConfig, hf: transformers.PreTrainedModel, rng: random.Random,
                  vocab: int) -> dict[str, dict[str, float]]:
    """Decode steps at long contexts: the engine with its paged kernel, the same engine with the kernel off
    (blocks gathered per layer, then SDPA: the path before the kernel), and transformers, in turn per case.
    Prompts of exactly `n` tokens, so every sequence of a batch decodes at the same context. With
    `context_kv_cache_dtypes`, an engine over a cache of each of those dtypes runs each case too."""
    engine = load_context_engine(cfg)
    narrow = {dtype: load_context_engine(cfg, dtype) for dtype in cfg.context_kv_cache_dtypes}
    kernels = engine.runner.kernels
    results = {}
    for batch, n in context_cases(cfg):
        prompts = [random_prompt(rng, n, vocab) for _ in range(batch)]
        steps = cfg.context_steps
        engine_prefill_into_cache(engine, prompts)
        e = engine_decode_step(engine, prompts, steps)  # both engine runs hit the prefix cache
        engine.runner.kernels = None
        g = engine_decode_step(engine, prompts, steps)
        engine.runner.kernels = kernels
        h = hf_decode_step(hf, prompts, steps)
        case = results[f"b{batch}_ctx{n}"] = {
            "batch": batch, "context": n, "engine_step_ms": e * 1e3, "gather_step_ms": g * 1e3,
            "hf_step_ms": h * 1e3, "engine_tok_s": batch / e, "gather_tok_s": batch / g, "hf_tok_s": batch / h}
        note = ""
        for dtype, other in narrow.items():
            engine_prefill_into_cache(other, prompts)
            w = engine_decode_step(other, prompts, steps)
            case.update({f"kv_{dtype}_step_ms": w * 1e3, f"kv_{dtype}_tok_s": batch / w})
            note += f", {dtype} KV {w * 1e3:.1f}"
        progress(f"decode batch {batch} at {n} tokens: engine {e * 1e3:.1f} ms/step, kernel off "
                 f"{g * 1e3:.1f}, HF {h * 1e3:.1f}{note}"
                 + ("" if kernels else " (no kernel: both engine columns gather)"))
    return results


def context_ratios(context: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per case: the engine against its own kernel-off path and against HF; per batch: the step at each
    context over the step at the shortest."""
    out = {}
    for key, c in context.items():
        out[f"decode_{key}_vs_gather"] = c["engine_tok_s"] / c["gather_tok_s"]
        out[f"decode_{key}_vs_hf"] = c["engine_tok_s"] / c["hf_tok_s"]
    for batch in sorted({c["batch"] for c in context.values()}):
        cases = sorted((c for c in context.values() if c["batch"] == batch), key=lambda c: c["context"])
        for c in cases[1:]:
            out[f"decode_b{batch}_ctx{c['context']}_vs_ctx{cases[0]['context']}_step"] = (
                c["engine_step_ms"] / cases[0]["engine_step_ms"])
            for dtype in narrow_dtypes(c):  # a narrow cache's own step growth, and its step against float32's
                out[f"decode_b{batch}_ctx{c['context']}_vs_ctx{cases[0]['context']}_step_{dtype}_kv"] = (
                    c[f"kv_{dtype}_step_ms"] / cases[0][f"kv_{dtype}_step_ms"])
    for key, c in context.items():
        for dtype in narrow_dtypes(c):
            out[f"decode_{key}_{dtype}_kv_vs_engine"] = c[f"kv_{dtype}_tok_s"] / c["engine_tok_s"]
    return out


def narrow_dtypes(case: dict[str, float]) -> list[str]:
    """The narrow caches a context case also ran over (its `kv_<dtype>_step_ms` keys)."""
    return [k.removeprefix("kv_").removesuffix("_step_ms") for k in case if k.startswith("kv_") and
            k.endswith("_step_ms")]


def warm_up(engine: LLMEngine, hf: transformers.PreTrainedModel, rng: random.Random, vocab: int) -> None:
    """One-time costs (oneDNN kernel selection, first allocations) stay out of every measurement."""
    prompts = [random_prompt(rng, 40, vocab) for _ in range(2)]
    engine_decode_step(engine, prompts, 4)
    hf_decode_step(hf, prompts, 4)


def run(cfg: BenchConfig, sections: Sequence[str] = SECTIONS) -> dict:
    torch.set_num_threads(cfg.threads)
    load_before = os.getloadavg()[0]
    progress(f"loading {MODEL} (fp32) into transformers and into the engine, {cfg.threads} threads")
    hf = load_hf()
    vocab = hf.config.vocab_size
    rng = random.Random(cfg.seed)
    mixed = mixed_workload(cfg, rng, vocab)
    engine = load_engine(cfg, mixed)
    weights = "GGUF blocks" if engine.model.quantized else "float32 matrices"
    progress(f"the engine's weights: {weights} ({engine.model.weight_bytes / 2**20:.0f} MiB)")
    warm_up(engine, hf, rng, vocab)

    spec_engine = load_spec_engine(cfg, engine)
    run_paired([DecodeRun(spec_engine, [random_prompt(rng, 40, vocab)], 4)])  # warm up

    decode = bench_decode(cfg, engine, hf, rng, vocab) if "decode" in sections else {}
    mixed_result = bench_mixed(cfg, engine, hf, mixed) if "mixed" in sections else {}
    prefill = bench_prefill(cfg, engine, hf, rng, vocab) if "prefill" in sections else {}
    roofline = bench_roofline(cfg, engine, rng, vocab) if "roofline" in sections else {}
    spec = bench_spec(cfg, engine, spec_engine) if "spec" in sections else {}
    del engine, spec_engine
    context = bench_context(cfg, hf, rng, vocab) if "context" in sections else {}
    longest = prefill.get("2048")
    return {
        "decode_b1_vs_hf": decode["1"]["engine_tok_s"] / decode["1"]["hf_tok_s"] if decode else None,
        "mixed_throughput_vs_hf": mixed_result["engine_tok_s"] / mixed_result["hf_tok_s"] if mixed_result else None,
        "prefill_2048_vs_hf": longest["engine_tok_s"] / longest["hf_tok_s"] if longest else None,
        "decode_b1_vs_roofline": roofline["engine_fraction"] if roofline else None,
        **{f"spec_ngram_{k.split('_')[1]}_vs_plain" + ("" if k.startswith("repetition") else "_chat"): v["ratio"]
           for k, v in spec.items()},
        **context_ratios(context),
        "model": MODEL, "dtype": "float32", "weights": weights, "threads": cfg.threads,
        "torch": torch.__version__,
        "load_avg": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(), "sections": list(sections),
        "transformers": transformers.__version__, "config": dataclasses.asdict(cfg),
        "decode": decode, "mixed": mixed_result, "prefill": prefill, "roofline": roofline, "speculation": spec,
        "context": context,
    }


def table(r: dict) -> str:
    rows = [f"{MODEL} float32 on CPU (the engine's weights in {r.get('weights', 'float32 matrices')}), "
            f"torch {r['torch']} with {r['threads']} threads, "
            f"transformers {r['transformers']}",
            f"{'':<30}{'engine':>12}{'transformers':>14}{'ratio':>9}"]

    def row(label: str, engine: float, hf: float, unit: str) -> None:
        rows.append(f"{label:<30}{engine:>9.1f}{unit:>3}{hf:>11.1f}{unit:>3}{engine / hf:>8.2f}x")

    for batch, d in r["decode"].items():
        row(f"decode batch {batch} (tok/s)", d["engine_tok_s"], d["hf_tok_s"], "")
    if m := r["mixed"]:
        row(f"mixed {m['requests']} req (output tok/s)", m["engine_tok_s"], m["hf_tok_s"], "")
    for n, p in r["prefill"].items():
        row(f"prefill {n} (tok/s)", p["engine_tok_s"], p["hf_tok_s"], "")
    for c in r["context"].values():
        row(f"decode b{c['batch']} ctx {c['context']} (tok/s)", c["engine_tok_s"], c["hf_tok_s"], "")
        rows.append(f"{'':<30}kernel off {c['gather_tok_s']:.1f} tok/s: the kernel "
                    f"{c['engine_tok_s'] / c['gather_tok_s']:.2f}x")
        for dtype in narrow_dtypes(c):
            rows.append(f"{'':<30}{dtype} KV cache {c[f'kv_{dtype}_tok_s']:.1f} tok/s: "
                        f"{c[f'kv_{dtype}_tok_s'] / c['engine_tok_s']:.2f}x the float32 cache")
    if f := r["roofline"]:
        rows.append(f"roofline: {f['bytes_per_step'] / 1e6:.1f} MB per decode step / {f['copy_gb_s']:.1f} GB/s "
                    f"copy = {f['step_ms']:.1f} ms; engine batch 1 beside it {f['engine_step_ms']:.1f} ms = "
                    f"{100 * f['engine_fraction']:.0f}% of the roofline; its matmuls alone "
                    f"{f['matmuls_ms']:.1f} ms = {100 * f['matmuls_fraction']:.0f}%")
    if m:
        rows.append(f"mixed: HF in static batches of {m['hf_batch']}, engine {m['engine_s']:.1f}s vs HF "
                    f"{m['hf_s']:.1f}s for {m['output_tokens']} output tokens")
    for name, v in r["speculation"].items():
        rows.append(f"speculation {name:<14} plain {v['plain_tok_s']:6.1f} tok/s, ngram {v['spec_tok_s']:6.1f} tok/s "
                    f"= {v['ratio']:.2f}x (acceptance {v['acceptance']:.2f}, {v['tokens_per_step']:.2f} tokens/step)")
    before, after = r["load_avg"]
    rows.append(f"load average {before:.1f} before, {after:.1f} after, on {r['cpus']} CPUs"
                + (" (other processes shared the cores: trust the ratios more than the numbers)"
                   if max(before, after) > r["cpus"] - r["threads"] + 0.5 else ""))
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run with small sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default 2)")
    parser.add_argument("--hf-batch", type=int, default=None, help="HF's static batch in the mixed workload")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated parts to run (default all: {','.join(SECTIONS)})")
    parser.add_argument("--context-lens", default=None,
                        help="the context section's tokens of context, comma-separated (default 16,256,1024,4096)")
    parser.add_argument("--context-batches", default=None,
                        help="the context section's batch sizes, comma-separated (default 1,8,32)")
    parser.add_argument("--quantization", choices=["gguf", "none"], default=None,
                        help="the engine's weights: SmolLM2's GGUF blocks (gguf, the default) or the "
                             "dequantised float32 matrices (none) that transformers reads either way")
    parser.add_argument("--context-kv-cache-dtype", default=None,
                        help="the context section also runs every case over KV caches of these dtypes, "
                             f"side by side (comma-separated, of {', '.join(NARROW)})")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(unknown)}; the sections are {', '.join(SECTIONS)}")
    cfg = dataclasses.replace(QUICK if args.quick else BenchConfig(), threads=args.threads)
    if args.hf_batch is not None:
        cfg = dataclasses.replace(cfg, hf_batch=args.hf_batch)
    if args.quantization is not None:
        cfg = dataclasses.replace(cfg, quantization=args.quantization)
    if args.context_lens:
        cfg = dataclasses.replace(cfg, context_lens=tuple(int(n) for n in args.context_lens.split(",")))
    if args.context_batches:
        cfg = dataclasses.replace(cfg, context_batches=tuple(int(b) for b in args.context_batches.split(",")))
    if args.context_kv_cache_dtype:
        names = [d for d in args.context_kv_cache_dtype.split(",") if d]
        if bad := [d for d in names if d not in NARROW]:
            parser.error(f"--context-kv-cache-dtype: {bad} not of {', '.join(NARROW)}")
        once: dict[str, str] = {}  # one engine a dtype (fp8 is fp8_e4m3), in the order first named
        for d in names:
            once.setdefault(FP8_KV_DTYPES.get(d, d), d)
        cfg = dataclasses.replace(cfg, context_kv_cache_dtypes=tuple(once.values()))
    result = run(cfg, sections)
    progress("done")
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
