"""GGUF weights kept in their blocks (`engine.quant`, `engine/kernels/gguf_matmul.cpp`).

Blocks are made by the `gguf` package's own quantiser and read back by its own dequantiser: the reference is
independent of ours. The kernel must decode every weight to exactly the float32 value `gguf` gives, and
multiply like a float32 matmul over those values (the sums' order aside), at every batch width and shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import quant
from engine.config import EngineConfig
from engine.hub import gguf_source
from engine.kernels import gguf_kernels
from engine.quant import WIDE_ROWS, BlockQuantized, QuantizedMatmul
from tests.engine.helpers import rel_err

KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def blocks(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[BlockQuantized, torch.Tensor]:
    """Random weights quantised by `gguf`, and the float32 matrix `gguf` dequantises them to."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    return BlockQuantized.from_gguf(kind, raw, rows), dense


@pytest.fixture(scope="module")
def kernels():
    k = gguf_kernels()
    if k is None:
        pytest.skip("the GGUF kernel could not be built here (no compiler): the engine dequantises at load")
    return k


COLS = [96, 544]  # 3 blocks a row; 17 (a row's scales widened by the vector loop and its tail)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cols", COLS)
def test_both_decoders_give_the_gguf_packages_float32_weights_in_value(kind, cols, kernels):
    # (equal in value: Q4_0 is kept as Q4_1 with m = -8d, whose 8 * d - 8 * d is +0.0 where gguf gives -0.0)
    b, dense = blocks(kind, 37, cols)
    assert b.shape == (37, cols)
    assert torch.equal(b.dequantize(), dense)
    assert torch.equal(b.dequantize(kernels), dense)
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(b.rows(ids), dense[ids])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 17, 28, 29, WIDE_ROWS, WIDE_ROWS + 1,
                                  100])
@pytest.mark.parametrize("cols", COLS)
def test_the_kernel_equals_a_matmul_over_the_dequantised_weights(kind, rows, cols, kernels):
    # 37 output rows: W rows left over after every tile (8, 6, 4, 2, and the broadcasts' 12); x rows: each
    # tile shape (1-2, 3-4, 5-8, wider, 29-32), under, at and over a tile and the wide cut
    # (the reference is float64: a float32 matmul's own rounding, up to 7e-7 here, is the kernel's size)
    b, dense = blocks(kind, 37, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    run = kernels.q8_0_linear if b.kind == "Q8_0" else kernels.q4_1_linear
    got = run(x, *(t for t in (b.codes, b.scales, b.offsets) if t is not None))
    assert rel_err(got.double(), x.double() @ dense.double().T) < 1e-6
    # (seeded: over 300 unseeded draws of the scale, bias and `other` at 32 x 544 the error reached 1.7e-6,
    # float32 sums of 544 terms; 3e-6 holds that with room, a wrong weight or row is off by far more)
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    bias, scale = torch.randn(37, generator=g), torch.rand(cols, generator=g) + 0.5
    m = QuantizedMatmul(b, kernels, bias, scale)
    ref = F.linear((x * scale).double(), dense.double(), bias.double())
    assert rel_err(m(x).double(), ref) < 3e-6
    other = torch.randn(rows, 37, generator=g)
    assert rel_err(m.add(x, other).double(), ref + other) < 3e-6
    assert rel_err(m.mul(x, other).double(), ref * other) < 3e-6
    assert rel_err(m.silu(x).double(), F.silu(ref)) < 3e-6


@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_the_fused_norm_and_gated_product_equal_their_torch_ops(rows, kernels):
    from engine.models.llama import unit_rms

    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 2 * 576, generator=g) * 5)[:, ::2]  # (strided: the op takes any layout)
    assert not h.is_contiguous()
    scale, eps = torch.rand(576, generator=g) + 0.5, 1e-5 * 576
    ref = unit_rms(h.double(), eps) * scale.double()
    assert rel_err(kernels.rms_scale(h, scale, eps).double(), ref) < 1e-6
    gate_up = torch.randn(rows, 2 * 96, generator=g) * 6
    gate, up = gate_up.double()[:, :96], gate_up.double()[:, 96:]
    assert rel_err(kernels.silu_mul(gate_up).double(), F.silu(gate) * up) < 1e-6
    # silu's tails, element by element: exp(-g) overflows float32 below g = -88.7 (it once made NaN there)
    tails = torch.tensor([-1e4, -100.0, -89.0, -88.0, -50.0, -1.0, 0.0, 1.0, 50.0, 89.0, 100.0, 1e4] * 2)
    got = kernels.silu_mul(torch.cat([tails, torch.full_like(tails, 3.0)]).repeat(rows, 1))
    want = (F.silu(tails.double()) * 3).float().expand(rows, -1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.rms_scale(h, scale[:100], eps)
    with pytest.raises(RuntimeError, match="must be even"):
        kernels.silu_mul(gate_up[:, 1:].contiguous())
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.silu_mul(torch.zeros(4, 8).t())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 32, 40])
def test_a_fused_gate_up_split_and_normed_equals_the_two_matrices(kind, rows, kernels):
    """The gated MLP of a quantised model: [gate; up] in one matrix, `swiglu` normed and gated in one
    call each, equal to the two matrices run on their own (views of the same blocks, `split`)."""
    from engine.models.llama import unit_rms

    b, dense = blocks(kind, 2 * 40, 96, seed=rows)
    g = torch.Generator().manual_seed(rows)
    scale, eps = torch.rand(96, generator=g) + 0.5, 1e-5 * 96
    fused = QuantizedMatmul(b, kernels, None, scale)
    gate, up = fused.split(40)
    assert gate.weight.codes.data_ptr() == b.codes.data_ptr()  # views, not copies
    h = torch.randn(rows, 96, generator=g)
    x = unit_rms(h, eps)
    assert rel_err(fused.normed(h, eps).double(), fused(x).double()) < 1e-6
    xs = (x * scale).double()
    want = F.silu(xs @ dense[:40].double().T) * (xs @ dense[40:].double().T)
    assert rel_err(fused.swiglu(h, eps).double(), want) < 3e-6
    assert rel_err(up.mul(x, gate.silu(x)).double(), want) < 3e-6


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_rows", [12, 46, 59])
def test_the_broadcast_path_stores_every_output_row_once(kind, out_rows, kernels):
    # 29-32 rows of x take the broadcasts, 12 W rows a task: 46 and 59 leave a last task of 10 and 11 rows
    # (rows past them repeat the last and must not be stored), 12 none
    b, dense = blocks(kind, out_rows, 96, seed=out_rows)
    matmul = QuantizedMatmul(b, kernels)  # (at most WIDE_ROWS rows of x: the kernel itself)
    for rows in (29, 31):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        got = matmul(x)
        assert got.shape == (rows, out_rows)
        assert rel_err(got.double(), x.double() @ dense.double().T) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_a_wide_call_dequantises_the_matrix_a_piece_at_a_time(kind, kernels, monkeypatch):
    # 37 W rows in pieces of 10 (the last 7): each piece's columns of the output and its bias; the float32
    # weight a call holds at once is a piece's
    b, dense = blocks(kind, 37, 96, seed=7)
    monkeypatch.setattr(quant, "WIDE_PIECE_BYTES", 10 * 96 * 4)
    pieces = []
    dequantize = BlockQuantized.dequantize

    def watched(self, kernels=None):
        pieces.append(self.shape)
        return dequantize(self, kernels)

    monkeypatch.setattr(BlockQuantized, "dequantize", watched)
    g = torch.Generator().manual_seed(1)
    bias, scale = torch.randn(37, generator=g), torch.rand(96, generator=g) + 0.5
    x = torch.randn(WIDE_ROWS + 5, 96, generator=g)
    got = QuantizedMatmul(b, kernels, bias, scale)(x)
    assert pieces == [(10, 96)] * 3 + [(7, 96)]
    assert got.shape == (WIDE_ROWS + 5, 37)
    assert rel_err(got.double(), F.linear((x * scale).double(), dense.double(), bias.double())) < 3e-6


def test_fused_matrices_keep_their_rows_and_mixed_types_are_refused():
    a, da = blocks("Q4_1", 8, 64, seed=1)
    b, db = blocks("Q4_1", 5, 64, seed=2)
    assert torch.equal(BlockQuantized.cat([a, b]).dequantize(), torch.cat([da, db]))
    c, dc = blocks("Q4_0", 3, 64, seed=3)  # (kept in Q4_1's form: it fuses with Q4_1)
    assert torch.equal(BlockQuantized.cat([a, c]).dequantize(), torch.cat([da, dc]))
    e, _ = blocks("Q8_0", 5, 64)
    with pytest.raises(ValueError, match="different GGUF types"):
        BlockQuantized.cat([a, e])


def test_bad_inputs_are_refused_with_the_shape_named(kernels):
    b, _ = blocks("Q4_1", 4, 64)
    with pytest.raises(RuntimeError, match="inner dimension"):
        kernels.q4_1_linear(torch.randn(2, 96), b.codes, b.scales, b.offsets)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_1_linear(torch.randn(2, 64, dtype=torch.float64), b.codes, b.scales, b.offsets)
    with pytest.raises(ValueError, match="only Q4_0, Q4_1, Q8_0"):
        BlockQuantized.from_gguf("Q5_K", np.zeros(176, dtype=np.uint8), 1)


def test_quantization_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig(model="tiny-random", quantization="int4")
    with pytest.raises(ValueError, match="built-in engine's"):
        EngineConfig(model="smollm2-135m", quantization="gguf", backend="vllm")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        gguf_source(str(hf_dir), hf_dir, "gguf")
    assert gguf_source(str(hf_dir), hf_dir, None) is None
    assert gguf_source("x.gguf", tmp_path / "x.gguf", None) == tmp_path / "x.gguf"
    assert gguf_source("x.gguf", tmp_path / "x.gguf", "none") is None
    assert gguf_source("smollm2-135m", hf_dir, None).suffix == ".gguf"  # (shipped as GGUF)
    assert gguf_source("smollm2-135m", hf_dir, "none") is None


@pytest.mark.slow
def test_the_portable_path_equals_the_avx512_one(tmp_path, kernels):
    """The kernel built without AVX-512 (the vector-extension form an AVX2 or ARM machine compiles) gives what
    the AVX-512 build gives; only the order of the sums may differ."""
    from torch.utils import cpp_extension

    from engine.kernels import CFLAGS, GGUF_SOURCES

    # (-O1: the test reads values, not speed, and builds in 60% of -O3's time)
    portable = cpp_extension.load(name="pdserve_gguf_portable", sources=[str(s) for s in GGUF_SOURCES],
                                  extra_cflags=[*CFLAGS, "-mno-avx512f", "-O1"], extra_ldflags=["-fopenmp"],
                                  build_directory=str(tmp_path), verbose=False)
    for kind, cols in ((kind, cols) for kind in KINDS for cols in COLS):
        b, dense = blocks(kind, 37, cols, seed=3)
        parts = [t for t in (b.codes, b.scales, b.offsets) if t is not None]
        assert torch.equal(portable.dequantize(*parts), dense)
        name = "q8_0_linear" if b.kind == "Q8_0" else "q4_1_linear"
        for rows in (1, 3, 5, 9, 33):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
            assert rel_err(getattr(portable, name)(x, *parts), getattr(kernels, name)(x, *parts)) < 1e-6
