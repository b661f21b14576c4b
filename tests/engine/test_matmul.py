"""The CPU fast path of the model's matrix multiplies: weights prepacked for oneDNN.

`Matmul` uses private torch ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`) and falls
back to F.linear when they are missing. That fallback is silent and costs about 1.7x at batch-1 decode, so
with the torch this project pins, packing must be what runs: if an upgrade renames the ops, this fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.llama import Matmul
from tests.engine.helpers import make_engine, rel_err


def test_every_cpu_fp32_weight_of_the_model_is_packed():
    model = make_engine().runner.model
    matmuls = [model.lm_head] + [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate,
                                                                           layer.up, layer.down)]
    unpacked = [i for i, m in enumerate(matmuls) if not m.packed]
    assert not unpacked, (f"{len(unpacked)}/{len(matmuls)} weights fell back to F.linear: torch "
                          f"{torch.__version__} lacks the oneDNN linear ops (mkldnn available: "
                          f"{torch.backends.mkldnn.is_available()})")


def test_packed_matmul_equals_f_linear_for_every_batch_shape():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    m = Matmul(weight)
    assert m.packed
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64, generator=gen)
        ref = F.linear(x, weight)
        assert rel_err(m(x), ref) < 1e-5
        other = torch.randn(rows, 96, generator=gen)
        # the oneDNN post-op variants the decode step uses
        assert rel_err(m.add(x, other), ref + other) < 1e-5
        assert rel_err(m.mul(x, other), ref * other) < 1e-5
        assert rel_err(m.silu(x), F.silu(ref)) < 1e-5


def test_other_dtypes_take_f_linear():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    m = Matmul(weight)
    assert not m.packed
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(m(x), F.linear(x, weight))
    other = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(m.add(x, other), F.linear(x, weight) + other)
    assert torch.equal(m.silu(x), F.silu(F.linear(x, weight)))
