"""Turns the last-position logits of each sequence into its next token."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [num_seqs, vocab]; one token per row. Greedy rows are batched; random rows sample alone so a
    seeded request draws from its own generator and gets the same tokens whatever it is batched with."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i].float(), p, generators[i])
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # NOTE: the generator lives on the CPU, so the draw does too; one row's probabilities are small.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
