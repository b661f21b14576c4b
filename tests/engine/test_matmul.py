"""The CPU fast path of the model's matrix multiplies: weights prepacked for oneDNN.

`Matmul` uses private torch ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`) and falls
back to F.linear when they are missing. That fallback is silent and costs about 1.7x at batch-1 decode, so
with the torch this project pins, packing must be what runs: if an upgrade renames the ops, this fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.llama import Matmul, _can_pack
from tests.engine.helpers import make_engine, rel_err


def test_every_cpu_fp32_weight_of_the_model_is_packed():
    model = make_engine().runner.model
    matmuls = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate,
                                                                           layer.up, layer.down)]
    unpacked = [i for i, m in enumerate(matmuls) if not m.packed]
    assert not unpacked, (f"{len(unpacked)}/{len(matmuls)} weights fell back to F.linear: torch "
                          f"{torch.__version__} lacks the oneDNN linear ops (mkldnn available: "
                          f"{torch.backends.mkldnn.is_available()})")


BF16_PACKS = _can_pack(torch.zeros(1, 1, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5),
                                       # (a fused post-op rounds once to bfloat16, the plain ops twice)
                                       (torch.bfloat16, 6e-3)])
def test_packed_matmul_equals_f_linear_for_every_batch_shape(dtype, tol):
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("this CPU has no oneDNN bfloat16 kernels: bfloat16 takes F.linear (next test)")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    m = Matmul(weight)
    assert m.packed
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        ref = F.linear(x, weight)
        assert m(x).dtype == dtype
        assert rel_err(m(x).float(), ref.float()) < (1e-5 if dtype == torch.float32 else 4e-3)  # (an ulp)
        other = torch.randn(rows, 96, generator=gen).to(dtype)
        # the oneDNN post-op variants the decode step uses
        assert rel_err(m.add(x, other).float(), (ref + other).float()) < tol
        assert rel_err(m.mul(x, other).float(), (ref * other).float()) < tol
        assert rel_err(m.silu(x).float(), F.silu(ref).float()) < tol


def test_other_dtypes_take_f_linear():
    dtype = torch.float16 if BF16_PACKS else torch.bfloat16  # (float16 is never packed)
    weight = torch.randn(8, 4, dtype=dtype)
    m = Matmul(weight)
    assert not m.packed
    x = torch.randn(2, 4, dtype=dtype)
    assert torch.equal(m(x), F.linear(x, weight))
    other = torch.randn(2, 8, dtype=dtype)
    assert torch.equal(m.add(x, other), F.linear(x, weight) + other)
    assert torch.equal(m.silu(x), F.silu(F.linear(x, weight)))
