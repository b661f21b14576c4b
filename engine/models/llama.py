"""The Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2) over a paged KV cache.

Weights are plain tensors (matrices wrapped in `Matmul`), not nn.Modules: a decode step at batch 1 is
bound by reading the weights, and per-module Python overhead is what separates a naive implementation from
the bandwidth roofline. Q/K/V and gate/up are fused into one matmul each, and q and k are rotated in one
call with position tables looked up once per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models.rope import RotaryEmbedding

# called with a layer index right after that layer's KV has been written to the cache
LayerHook = Callable[[int], None]


class Matmul:
    """`x @ weight.T` for one [out, in] weight, kept in the layout that streams fastest on its device.

    NOTE: on CPU (float32) the weight is reordered once into oneDNN's blocked layout and applied with the op
    inductor uses for frozen linears. Against `x @ w` over an [in, out] copy (MKL sgemm), 2 threads:
    lm_head 2.6 vs 4.2 ms at batch 1 (MKL's GEMV ran as fast on 1 thread as on 2), 2.9 vs 10.6 ms at
    batch 8; gate_up at 512 tokens 4.0 vs 9.6 ms. End to end: decode 1.8x faster at batch 1, 2.5x at
    batch 8, prefill 1.5-2x. Other devices and dtypes: F.linear.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matmul  # [q_size + 2 * kv_size, hidden]
    o: Matmul  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matmul  # [2 * intermediate, hidden]
    down: Matmul  # [hidden, intermediate]


class LlamaForCausalLM:
    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return state_dict[name].to(device=device, dtype=dtype)

        def t(*names: str) -> Matmul:  # [out, in] matrices, fused along out
            return Matmul(torch.cat([w(n) for n in names]))

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = w("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in state_dict
        self.lm_head = Matmul(self.embed if tied else w("lm_head.weight"))  # [vocab, hidden]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=t(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
                o=t(p + "self_attn.o_proj.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=t(p + "mlp.down_proj.weight"),
            ))
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                                    dtype, device)
        self.scale = config.head_dim ** -0.5

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm]
        matrices = [self.lm_head]
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.mlp_norm]
            matrices += [layer.qkv, layer.o, layer.gate_up, layer.down]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(m.nbytes for m in matrices)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor,
                layer_hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (the flattened batch); returns logits [len(logits_indices), vocab]."""
        c = self.config
        eps = c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        T = h.shape[0]
        cos, sin = self.rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer.attn_norm, eps)
            qkv = layer.qkv(x)  # [T, q_size + 2 * kv_size]
            qk = qkv[:, :c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = self.rope.rotate(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, c.q_size + c.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_cache.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            if layer_hook is not None:
                layer_hook(i)
            h = h + layer.o(attn.reshape(T, c.q_size))
            x = F.rms_norm(h, (c.hidden_size,), layer.mlp_norm, eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        h = F.rms_norm(h[logits_indices], (c.hidden_size,), self.norm, eps)
        return self.lm_head(h).float()
