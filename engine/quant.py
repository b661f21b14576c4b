"""Weights kept in GGUF's block-quantised formats (Q4_0, Q4_1, Q8_0) and the matmul that reads them.

A GGUF checkpoint (llama.cpp's format; the built-in SmolLM2 ships as one) stores each row of a matrix in
blocks of 32 weights: Q4_1 as 4-bit codes with a half-precision scale and offset per block (w = d * q + m),
Q8_0 as 8-bit codes with a scale (w = d * q), Q4_0 as 4-bit codes with a scale (w = d * (q - 8), kept here
as Q4_1). `--quantization gguf` keeps them as the file has them: a decode step, which streams every matrix
once, reads 5 (Q4_1) or 8.5 (Q8_0) bits a weight instead of 32, and the CPU kernel
(`engine/kernels/gguf_matmul.cpp`) decodes each weight in registers into exactly the float32 value the
dequantised checkpoint holds (d * q is exact in float32). Activations and sums stay float32, so the
model is the float32 one: its logits match transformers' on the dequantised weights to float32 rounding.
Batches wider than `WIDE_ROWS` (prefill chunks) dequantise the matrix for the call and take a float32 matmul,
which is faster there than decoding per row of x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32
# GGUF type name -> (bytes of one block, bytes of its codes). Q4_0 (w = d * (q - 8)) is kept as Q4_1 with
# m = -8d (exact in float16 short of overflow: `Q4_0Overflow`, and the loader dequantises that matrix):
# d * q and -8d are exact in float32 and so is their sum, so the kernel's fma gives gguf's value.
KINDS = {"Q4_0": (18, 16), "Q4_1": (20, 16), "Q8_0": (34, 32)}
# NOTE: at most this many rows of x take the kernel; wider ones dequantise and run a float32 matmul. Measured
# on SmolLM2's shapes, 2 threads (2026-12-07): the kernel was 1.2-1.4x oneDNN's float32 matmul at 16 rows,
# 0.6x at 128 and 0.2-0.4x at 512, where dequantising for the call and F.linear matched oneDNN within 10%.
WIDE_ROWS = 32
# NOTE: a wide call dequantises at most this many bytes of float32 weight at once, a piece of the matrix's
# rows at a time: an 8B model's fused [gate; up] is 470 MB as float32, its lm_head 2 GB. SmolLM2's largest
# matrix (the tied lm_head, 113 MB) takes two pieces; the others one, as before.
WIDE_PIECE_BYTES = 64 << 20


class Q4_0Overflow(ValueError):
    """A Q4_0 block whose -8d does not fit a float16: that matrix cannot be kept as Q4_1 (`from_gguf`)."""


@dataclass
class BlockQuantized:
    """One [N, K] matrix in GGUF blocks, repacked for the kernel: codes [N, K/32, 16] uint8 (Q4_1, and Q4_0
    in its form; byte j holds weight j in its low nibble and j + 16 in its high one) or [N, K/32, 32] int8
    (Q8_0); scales and offsets [N, K/32] float16, as GGUF stores them; offsets only for Q4_1."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, rows: int) -> BlockQuantized:
        """`raw`: the tensor's bytes as GGUF stores them, `rows` rows of whole blocks."""
        if kind not in KINDS:
            raise ValueError(f"GGUF type {kind} is not kept quantised (only {', '.join(KINDS)})")
        size, code_bytes = KINDS[kind]
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, size)

        def half(at: int) -> torch.Tensor:
            return torch.from_numpy(blocks[..., at:at + 2].copy().view(np.float16)[..., 0].copy())

        codes = np.ascontiguousarray(blocks[..., size - code_bytes:])
        if kind == "Q8_0":
            return cls(kind, torch.from_numpy(codes.view(np.int8)), half(0), None)
        if kind == "Q4_0":
            d = half(0)
            m = d * -8
            if not torch.isfinite(m).all():
                raise Q4_0Overflow("a Q4_0 scale too large to keep as Q4_1 (-8d overflows float16)")
            return cls("Q4_1", torch.from_numpy(codes), d, m)
        return cls(kind, torch.from_numpy(codes), half(0), half(2))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> BlockQuantized:
        """The same blocks with `fn` (an array -> array function over the leading, row, axis) applied to
        each part: llama.cpp's q/k row permutation, undone."""
        def apply(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))
        return BlockQuantized(self.kind, apply(self.codes), apply(self.scales),
                              None if self.offsets is None else apply(self.offsets))

    @staticmethod
    def cat(parts: list[BlockQuantized]) -> BlockQuantized:
        """Matrices stacked along their rows (fused q/k/v), all of one kind."""
        if len(parts) == 1:
            return parts[0]  # (no copy: a tied lm_head shares the embedding's blocks)
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse matrices of different GGUF types {sorted(kinds)}")
        offsets = [p.offsets for p in parts]
        return BlockQuantized(parts[0].kind, torch.cat([p.codes for p in parts]),
                              torch.cat([p.scales for p in parts]),
                              None if offsets[0] is None
                              else torch.cat([o for o in offsets if o is not None]))

    def row_range(self, start: int, stop: int) -> BlockQuantized:
        """Rows `start:stop`, as views of these blocks (no copy)."""
        return BlockQuantized(self.kind, self.codes[start:stop], self.scales[start:stop],
                              None if self.offsets is None else self.offsets[start:stop])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` (an embedding lookup), decoded with torch ops."""
        return _decode(self.codes[ids], self.scales[ids], None if self.offsets is None else self.offsets[ids])

    def dequantize(self, kernels: ModuleType | None = None) -> torch.Tensor:
        """The float32 [N, K] matrix the `gguf` package dequantises: bit for bit, but for Q4_0's zeros
        (+0.0 here, -0.0 there; equal in value)."""
        if kernels is not None:
            out: torch.Tensor = kernels.dequantize(self.codes, self.scales, self.offsets)
            return out
        return _decode(self.codes, self.scales, self.offsets)


def _decode(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    if offsets is None:
        w = codes.float() * scales.float().unsqueeze(-1)
    else:
        q = torch.cat([codes & 15, codes >> 4], dim=-1).float()
        # (d * q is exact: one rounding, as gguf's)
        w = q * scales.float().unsqueeze(-1) + offsets.float().unsqueeze(-1)
    return w.flatten(-2)


class QuantizedMatmul:
    """`(x * in_scale) @ weight.T (+ bias)` over a `BlockQuantized` weight on the CPU, float32 throughout; the
    same interface as `engine.models.llama.Matmul`. `in_scale`: an RMSNorm's weight (times sqrt(hidden)),
    which the float32 path folds into the matrix's columns and a quantised matrix cannot take."""

    def __init__(self, weight: BlockQuantized, kernels: ModuleType, bias: torch.Tensor | None = None,
                 in_scale: torch.Tensor | None = None) -> None:
        self.weight, self.kernels, self.bias, self.in_scale = weight, kernels, bias, in_scale
        self.nbytes = weight.nbytes + sum(t.numel() * t.element_size() for t in (bias, in_scale)
                                          if t is not None)
        self._run = kernels.q8_0_linear if weight.kind == "Q8_0" else kernels.q4_1_linear
        self._parts = [t for t in (weight.codes, weight.scales, weight.offsets) if t is not None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x if self.in_scale is None else x * self.in_scale)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > WIDE_ROWS:
            return self._wide(x)
        out: torch.Tensor = self._run(x, *self._parts)
        return out if self.bias is None else out.add_(self.bias)

    def _wide(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 matmul over the matrix dequantised `WIDE_PIECE_BYTES` at a time."""
        n, k = self.weight.shape
        step = max(1, WIDE_PIECE_BYTES // (4 * k))
        if step >= n:
            return F.linear(x, self.weight.dequantize(self.kernels), self.bias)
        out = x.new_empty(x.shape[0], n)
        for start in range(0, n, step):
            stop = min(start + step, n)
            piece = self.weight.row_range(start, stop).dequantize(self.kernels)
            out[:, start:stop] = F.linear(x, piece, None if self.bias is None else self.bias[start:stop])
        return out

    def normed(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """`self(unit_rms(h, eps))` (`engine.models.llama.unit_rms`): the norm and `in_scale` in one pass."""
        if self.in_scale is None:
            raise ValueError("normed() needs the norm's weight as in_scale")
        return self._matmul(self.kernels.rms_scale(h, self.in_scale, eps))

    def split(self, rows: int) -> tuple[QuantizedMatmul, QuantizedMatmul]:
        """Rows `:rows` and `rows:` as two matmuls over views of these blocks, with the same `in_scale`."""
        if self.bias is not None:
            raise ValueError("split() is for matrices without a bias")
        return (QuantizedMatmul(self.weight.row_range(0, rows), self.kernels, None, self.in_scale),
                QuantizedMatmul(self.weight.row_range(rows, self.weight.shape[0]), self.kernels, None,
                                self.in_scale))

    def swiglu(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) with x = `unit_rms(h, eps)`, for this [gate; up] matrix (the
        gated MLP's two inputs fused, one norm and one matmul a step instead of two of each)."""
        out: torch.Tensor = self.kernels.silu_mul(self.normed(h, eps))
        return out

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self(x))

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).add_(other)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).mul_(other)
