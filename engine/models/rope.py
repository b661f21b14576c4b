"""Rotary position embeddings (HF Llama convention: rotate the two halves of each head)."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.config import ROPE_TYPES


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


class RotaryEmbedding:
    """`lookup` once per forward, then `rotate` q and k of every layer with what it returned."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.half = head_dim // 2
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # NOTE: HF rotates as x * cos + cat(-x2, x1) * sin. We compute roll(x) * sin_signed, i.e.
        # cat(x2, x1) * cat(-sin1, sin2): the same products in 3 ops per layer instead of 7
        # (addcmul: the second product and the sum in one op).
        sin = emb.sin()
        sin[:, :self.half] *= -1
        self.sin_signed = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) of each position, each [T, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (q and k heads stacked is fine), rotated by `lookup`'s tables."""
        return torch.addcmul(x * cos, x.roll(self.half, dims=-1), sin_signed)
