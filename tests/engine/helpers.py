"""Small factories for engine tests."""

from __future__ import annotations

import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.checkpoint import byte_tokenizer, random_state_dict, write_checkpoint


def make_engine(model: str = "tiny-random", *, num_blocks: int | None = 256, block_size: int = 16,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                prefix_caching: bool = True, prefill_order: str = "fifo", device: str = "cpu",
                dtype: str = "float32", kv_cache_dtype: str | None = None, memory_bytes: int | None = None,
                **scheduler) -> LLMEngine:
    """An engine on `model`; `scheduler`: more `SchedulerConfig` fields."""
    return LLMEngine(EngineConfig(
        model=model, device=device, dtype=dtype,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, memory_bytes=memory_bytes,
                          dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefix_caching,
                                  prefill_order=prefill_order, **scheduler),
    ))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_capturing_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """Drive the engine to completion (greedy), recording the logits each request sampled from."""
    logits_by_req: dict[str, list[torch.Tensor]] = {}
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        logits = engine.runner.execute(out)
        for chunk, row in zip(out.chunks, logits):
            if chunk.end == chunk.request.num_tokens:  # a sampled position, not a partial prefill chunk
                logits_by_req.setdefault(chunk.request.request_id, []).append(row.clone())
        engine.scheduler.update(out, [[t] for t in logits.argmax(-1).tolist()])
    return logits_by_req


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_of_random_checkpoint(path, config, seed: int):
    """`config` written to `path` with random weights; transformers' model of it, of the class its config.json
    names (the independent reference)."""
    from transformers import AutoModelForCausalLM

    write_checkpoint(path, config, random_state_dict(config, seed=seed), byte_tokenizer(""))
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    assert type(hf).__name__ == config.to_hf()["architectures"][0]
    return hf
