"""One model replica and its step loop: schedule -> run -> sample -> update."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from engine.backend import EngineBackend, LayerHook, LayerHookFactory
from engine.block_allocator import BlockAllocator
from engine.config import (
    FP8_KV_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    refuse_fp8_off_cpu,
    refuse_narrow_cache_under_narrow_model,
)
from engine.gguf_loader import load_gguf_quantized
from engine.hub import gguf_source, log, resolve_model
from engine.kv_cache import KVCache, KVCacheSpec
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.quant import BlockQuantized
from engine.request import Request, RequestStatus
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.spec_decode import verify
from engine.tokenizer import Tokenizer, eos_token_id
from protocol import FinishReason
from protocol.messages import EngineLoad, LoadReport, StepStats

# share of the device's free memory (after weights) given to the KV cache when the config does not say
DEFAULT_MEMORY_FRACTION = {"cpu": 0.05, "cuda": 0.85}

Prompt = str | Sequence[int]
__all__ = ["LLM", "LLMEngine", "LayerHook", "LayerHookFactory", "RequestOutput"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def pick_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype: {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
    return value


def kv_cache_bytes(free: int, total: int, fraction: float, device_share: float = 1.0) -> int:
    """The KV cache's bytes: `fraction` of the device's free memory, and of no more than this engine's share of
    the whole device. NOTE: without the cap, two workers given half a GPU each were sized by start order: on
    an H200 the first took 121 GB, the second the 19 GB left (benchmarks/results/h200-2026-12-04)."""
    return int(min(free, total * device_share) * fraction)


class LLMEngine(EngineBackend):
    """The built-in engine: pdserve's own Llama runner, paged KV cache and scheduler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        refuse_fp8_off_cpu(config.cache.dtype, self.device.type)
        t0 = time.perf_counter()
        path = resolve_model(config.model)
        gguf = gguf_source(config.model, path, config.quantization)
        quantized: dict[str, BlockQuantized] = {}
        if gguf is None:
            model_config, state = load_checkpoint(path)
        else:
            model_config, state, quantized = load_gguf_quantized(str(gguf))
        self.model_config = model_config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = LlamaForCausalLM(model_config, state, self.dtype, self.device, self.max_model_len,
                                      quantized)
        del state, quantized
        self.path = path
        eos = set(model_config.eos_token_ids)
        if (tokenizer_eos := eos_token_id(path)) is not None:
            eos.add(tokenizer_eos)
        self.eos_token_ids = tuple(sorted(eos))

        self.kv_dtype = self.dtype if config.cache.dtype is None else pick_dtype(
            FP8_KV_DTYPES.get(config.cache.dtype, config.cache.dtype), self.device)
        refuse_narrow_cache_under_narrow_model(config.cache.dtype, str(self.dtype).removeprefix("torch."))
        self.cache_spec = KVCacheSpec(model_config.num_layers, model_config.num_kv_heads,
                                      model_config.head_dim, config.cache.block_size, self.kv_dtype)
        num_blocks = self._num_blocks(config.cache)
        self.kv_cache = KVCache(self.cache_spec, num_blocks, self.device)
        self.allocator = BlockAllocator(num_blocks, config.scheduler.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.allocator, config.cache.block_size, config.speculative)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self._ids = itertools.count()
        self.last_step: StepStats | None = None  # what the latest step that ran anything computed
        weights = (f", weights in GGUF blocks ({self.model.weight_bytes / 2**20:.0f} MiB)"
                   if self.model.quantized else "")
        log(f"loaded {config.model} ({model_config.num_params / 1e6:.0f}M params, {self.dtype}{weights}, "
            f"{self.device}) with {num_blocks} KV blocks of {config.cache.block_size} tokens "
            f"({self.kv_dtype}) in {time.perf_counter() - t0:.1f}s")

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, loaded on first use: a worker never uses it (the router tokenizes)."""
        return Tokenizer(self.path)

    def _num_blocks(self, cache: CacheConfig) -> int:
        fixed = cache.fixed_blocks(self.cache_spec.bytes_per_block)
        if fixed is not None:
            return fixed
        fraction = cache.memory_fraction or DEFAULT_MEMORY_FRACTION.get(self.device.type, 0.05)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            free = total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return KVCache.num_blocks_for_memory(self.cache_spec, kv_cache_bytes(free, total, fraction, cache.device_share))

    # -- requests ---------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Validate a prompt (text or token ids) and return its token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: id {bad} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def check_prompt_len(self, n: int) -> None:
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        capacity = self.allocator.num_blocks * self.cache_spec.block_size
        if n >= capacity:
            raise ValueError(f"prompt has {n} tokens, more than the KV cache holds ({capacity} tokens); "
                             "raise CacheConfig.num_blocks, memory_bytes or memory_fraction")

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        ids = self.tokenize(prompt)
        self.check_prompt_len(len(ids))
        request = Request(request_id or str(next(self._ids)), ids, params, self.cache_spec.block_size,
                          self.eos_token_ids, self.max_model_len)
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    # -- the worker-facing interface (`EngineBackend`) ---------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def enqueue(self, request: Request) -> None:
        self.scheduler.add(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)

    @property
    def requests(self) -> Mapping[str, Request]:
        return self.scheduler.requests

    @property
    def paused(self) -> Mapping[str, Request]:
        return self.scheduler.paused

    def pause(self, request_id: str) -> bool:
        return self.scheduler.pause(request_id)

    def resume(self, request_id: str) -> bool:
        return self.scheduler.resume(request_id)

    def reserve_for_kv(self, request: Request) -> list[int] | None:
        return self.scheduler.reserve_for_kv(request)

    def kv_received(self, request_ids: list[str]) -> None:
        self.scheduler.kv_received(request_ids)

    def kv_landed(self, request: Request, first_token: int) -> bool:
        return self.scheduler.kv_landed(request, first_token)

    def forget_kv(self, request_id: str, start: int) -> bool:
        return self.scheduler.forget_kv(request_id, start)

    def reset_prefix_cache(self) -> None:
        self.allocator.reset_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step loop ----------------------------------------------------------------------------------

    def has_scheduled_work(self) -> bool:
        """Whether `step` may compute anything (requests waiting on a KV transfer do not count; a prompt held
        for its KV destination does, and a step then schedules nothing for it)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def load(self) -> EngineLoad:
        s, a = self.scheduler, self.allocator
        return EngineLoad(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            queued_prefill_tokens=sum(r.num_tokens - r.num_computed_tokens for r in (*s.waiting, *s.running)
                                      if r.status in (RequestStatus.WAITING, RequestStatus.PREFILLING)),
            free_blocks=a.num_free_blocks,
            total_blocks=a.num_blocks,
            cached_blocks=a.num_cached_blocks,
            reserved_blocks=sum(len(r.block_ids) for r in s.requests.values()
                                if r.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.KV_LANDED)),
            spec=s.spec_stats,
        )

    def load_report(self, worker_id: str, since: int | None) -> LoadReport:
        """The load, and the prefix-cache changes after change number `since` (None: only the newest change's
        number, so a reader behind it knows to ask)."""
        if since is None:
            seq = self.allocator.events.seq
            return LoadReport(worker_id, self.load(), since=seq, seq=seq)
        c = self.allocator.changes_since(since)
        return LoadReport(worker_id, self.load(), c.stored, c.removed, c.since, c.seq, c.full)

    def step(self, layer_hook_for: LayerHookFactory | None = None) -> tuple[SchedulerOutput, list[Request]]:
        """One engine step. Returns what was scheduled and the requests that got a token (see
        `Scheduler.update`). `layer_hook_for` sees the step's schedule before the model runs and may return
        a hook called after each layer's KV is written (the prefill worker's layer-wise KV push)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.chunks:
            return out, []
        logits = self.runner.execute(out, layer_hook_for(out) if layer_hook_for else None)
        # each chunk's prompt tokens (0 for a decode row), counted before `update` advances the requests
        prompt_tokens = [max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in out.chunks]
        advanced = self.scheduler.update(out, sample_chunks(logits, out.chunks))
        seconds = time.perf_counter() - t0
        total = out.num_tokens
        for c, n in zip(out.chunks, prompt_tokens):
            if n:
                c.request.prefill_compute_s += seconds * c.num_tokens / total
        self.last_step = StepStats(seconds, sum(prompt_tokens), sum(1 for n in prompt_tokens if not n))
        return out, advanced

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                             self.tokenizer.decode(req.output_token_ids), req.finish_reason,
                             req.num_cached_tokens)


def sample_chunks(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[list[int]]:
    """The tokens each chunk appends: one sampled token, or for a chunk with drafts the verified ones.
    logits: [sum of chunk.num_logits, vocab], as `ModelRunner.execute` returns them."""
    offsets = list(itertools.accumulate((c.num_logits for c in chunks), initial=0))  # each chunk's first row
    plain = [i for i, c in enumerate(chunks) if not c.draft_token_ids]
    tokens: list[list[int]] = [[] for _ in chunks]
    if plain:  # batched, as without speculation
        first_rows = [offsets[i] for i in plain]
        # (every row, in order, as in a step with no drafts: the logits themselves, not a gathered copy of
        # them, 1.4 ms at 32 rows of SmolLM2's 49,152)
        picked = logits if first_rows == list(range(logits.shape[0])) else logits[first_rows]
        sampled = sample(picked, [chunks[i].request.params for i in plain],
                         [chunks[i].request.num_tokens for i in plain])
        for i, t in zip(plain, sampled):
            tokens[i] = [t]
    for i, c in enumerate(chunks):
        if c.draft_token_ids:
            rows = logits[offsets[i]:offsets[i + 1]]
            tokens[i] = verify(rows, c.request.params, c.request.num_tokens, c.draft_token_ids)
    return tokens


class LLM:
    """Offline batch generation: `LLM(model="smollm2-135m").generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = "smollm2-135m", *, device: str | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, num_threads: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, memory_fraction: float | None = None,
                 kv_cache_dtype: str | None = None, kv_cache_memory_bytes: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, seed: int = 0,
                 speculative: SpeculativeConfig | None = None, quantization: str | None = None) -> None:
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_bytes=kv_cache_memory_bytes,
                            memory_fraction=memory_fraction, dtype=kv_cache_dtype)
        self.engine = LLMEngine(EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=max_model_len, num_threads=num_threads,
            seed=seed, cache=cache,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_prefix_caching),
            speculative=speculative or SpeculativeConfig(), quantization=quantization,
        ))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        params = params or SamplingParams()
        # one prompt, text or token ids, or several
        many = (cast("Sequence[Prompt]", [prompts])
                if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts)
        # validate everything before queueing anything, so a bad prompt leaves no request behind
        ids = [self.engine.tokenize(cast("str | Sequence[int]", p)) for p in many]
        for p in ids:
            self.engine.check_prompt_len(len(p))
        requests = [self.engine.add_request(p, params) for p in ids]
        done = 0
        while self.engine.has_unfinished_requests():
            _, advanced = self.engine.step()
            finished = sum(r.is_finished for r in advanced)
            done += finished
            if use_tqdm and finished:
                print(f"\rgenerated {done}/{len(requests)}", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(file=sys.stderr)
        return [self.engine.output(r) for r in requests]
