"""The Llama family (Llama 2/3, Mistral, TinyLlama, SmolLM2) and Qwen2/Qwen3 over a paged KV cache.

Qwen2 is Llama with biases on q/k/v; Qwen3 is Llama with an RMSNorm over each head of q and k before
RoPE (`ModelConfig.qkv_bias`, `qk_norm`).

Weights are plain tensors (matrices wrapped in `Matmul`), not nn.Modules: a decode step at batch 1 is
bound by reading the weights, and per-module Python overhead is what separates a naive implementation from
the bandwidth roofline. Q/K/V are fused into one matmul (and gate/up, over GGUF blocks: float32 ones run as
two, each with its pointwise op fused in by oneDNN), and q and k are rotated in one call with position tables
looked up once per forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kernels import gguf_kernels
from engine.kv_cache import KVCache
from engine.models.rope import RotaryEmbedding
from engine.quant import BlockQuantized, QuantizedMatmul

log = logging.getLogger(__name__)

# called with a layer index right after that layer's KV has been written to the cache
LayerHook = Callable[[int], None]


class Matmul:
    """`x @ weight.T` for one [out, in] weight, kept in the layout that streams fastest on its device.

    NOTE: on CPU (float32) the weight is reordered once into oneDNN's blocked layout and applied with the op
    inductor uses for frozen linears. Against `x @ w` over an [in, out] copy (MKL sgemm), 2 threads:
    lm_head 2.6 vs 4.2 ms at batch 1 (MKL's GEMV ran as fast on 1 thread as on 2), 2.9 vs 10.6 ms at
    batch 8; gate_up at 512 tokens 4.0 vs 9.6 ms. End to end: decode 1.8x faster at batch 1, 2.5x at
    batch 8, prefill 1.5-2x. A bfloat16 weight (`--dtype bfloat16`) packs too where oneDNN reports bfloat16
    support (this machine: AMX and AVX-512 BF16; other CPUs unmeasured): the plain product equals F.linear's
    bit for bit here, a fused post-op rounds once where F.linear and the op round twice (an ulp), and
    decode steps ran 1.17-1.24x faster than with F.linear, prefill 0.96x (2026-12-07, SmolLM2, 2 threads).
    Other devices and dtypes: F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
        self.packed = _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return _packed(torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], ""))
        return F.linear(x, self.weight, self.bias)

    def normed(self, h: torch.Tensor, eps: float) -> torch.Tensor:
        """self(unit_rms(h, eps)): the norm's weight is in this matrix's columns"""
        return self(unit_rms(h, eps))

    # NOTE: the fused variants below run the pointwise op as a oneDNN post-op of the matmul, so a decode
    # step pays one op (and one pass over the output) instead of two; elsewhere they are the plain ops.

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ weight.T)"""
        if self.packed:
            return _packed(torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "swish", [], ""))
        return F.silu(F.linear(x, self.weight, self.bias))

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + other (a residual)"""
        if self.packed:
            return _packed(torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add"))
        return torch.add(F.linear(x, self.weight, self.bias), other)

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x @ weight.T) * other"""
        if self.packed:
            return _packed(torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "mul"))
        return torch.mul(F.linear(x, self.weight, self.bias), other)


def _packed(out: Any) -> torch.Tensor:
    """A oneDNN op's result (`torch.ops` calls are untyped)."""
    return cast(torch.Tensor, out)


def _can_pack(weight: torch.Tensor) -> bool:
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # (a private op: may go)
    return weight.dtype == torch.float32 or (bf16 is not None and bool(bf16()))


@dataclass
class LayerWeights:
    # NOTE: each RMSNorm's weight (times sqrt(hidden), see `unit_rms`) is folded into the columns of the
    # matrices that read its output: W @ (g * x) == (W * g) @ x. A norm is then 4 small ops, not F.rms_norm's
    # ~10 (it is a composite on CPU), and the weight multiply is gone.
    # (a GGUF model's quantised matrices are `QuantizedMatmul`s, which apply the norm to x instead of folding
    # it in: "folded in" below means the float32 matrices)
    qkv: Matmul | QuantizedMatmul  # [q_size + 2 * kv_size, hidden], attention norm folded in
    o: Matmul | QuantizedMatmul  # [hidden, q_size]
    gate: Matmul | QuantizedMatmul  # [intermediate, hidden], MLP norm folded in
    up: Matmul | QuantizedMatmul  # [intermediate, hidden], MLP norm folded in
    # quantised gate and up of one GGUF type: both in one matrix, [gate; up] (`gate` and `up` are views of it)
    gate_up: QuantizedMatmul | None
    down: Matmul | QuantizedMatmul  # [hidden, intermediate]
    norm_bytes: int  # the norm weights' bytes (what an unfused model reads; counted for the roofline)
    # [num_heads + num_kv_heads, head_dim]: q_norm's weight for each q head, then k_norm's (Qwen3)
    qk_norm: torch.Tensor | None


class LlamaForCausalLM:
    def __init__(self, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int,
                 quantized: dict[str, BlockQuantized] | None = None) -> None:
        """`quantized`: matrices kept in GGUF blocks (`engine.gguf_loader.load_gguf_quantized`). They run
        through the GGUF kernel on a float32 CPU model; elsewhere (another device or dtype, no kernel) they
        are dequantised here, and the model is the float32 one either way."""
        self.config = config
        self.dtype = dtype
        self.device = device
        quantized = quantized or {}
        kernels = gguf_kernels() if quantized and device.type == "cpu" and dtype == torch.float32 else None
        if quantized and kernels is None:
            log.info("GGUF blocks dequantised at load: the GGUF kernel runs float32 models on the CPU "
                     "(this one: %s on %s%s)", dtype, device, "" if device.type != "cpu" or dtype != torch.float32
                     else ", the kernel could not be built")
        self.quantized = kernels is not None
        present = state_dict.keys() | quantized.keys()

        def dense(name: str) -> torch.Tensor:
            return quantized[name].dequantize() if name in quantized else state_dict[name].float()

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return state_dict[name].to(device=device, dtype=dtype)

        def t(*names: str, norm: str | None = None, bias: bool = False) -> Matmul | QuantizedMatmul:
            """[out, in] matrices, fused along out, with the RMSNorm `norm` (if any) folded into columns, and
            their biases (`bias`: `*.bias` beside each `*.weight`) fused likewise (W (g x) + b: untouched)."""
            _present(present, *names)
            b = None
            if bias:
                b = torch.cat([state_dict[n] for n in _present(present, *(n.removesuffix("weight") + "bias"
                                                                        for n in names))])
                b = b.to(device=device, dtype=dtype).contiguous()
            g = None if norm is None else state_dict[norm].float() * config.hidden_size ** 0.5
            parts = [quantized.get(n) for n in names]
            if kernels is not None and all(parts) and len({p.kind for p in parts if p}) == 1:
                return QuantizedMatmul(BlockQuantized.cat([p for p in parts if p]), kernels, b, g)
            m = torch.cat([dense(n) for n in names])
            if g is not None:
                # in float32, then cast once: the folded weight rounds like one product, not two
                m = m * g
            return Matmul(m.to(device=device, dtype=dtype).contiguous(), b)

        def qk_norm(p: str) -> torch.Tensor | None:
            if not config.qk_norm:
                return None
            q, k = w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")
            return torch.cat([q.expand(config.num_heads, -1), k.expand(config.num_kv_heads, -1)]).contiguous()

        embed = "model.embed_tokens.weight"
        # [vocab, hidden]: a quantised embedding stays in its blocks (with the kernel) and decodes the rows
        # a step looks up
        self.embed: torch.Tensor | BlockQuantized = (
            quantized[embed] if kernels is not None and embed in quantized
            else dense(_present(present, embed)[0]).to(device=device, dtype=dtype))
        tied = config.tie_word_embeddings or "lm_head.weight" not in present
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head = t(head, norm="model.norm.weight")  # [vocab, hidden]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn_norm, mlp_norm = p + "input_layernorm.weight", p + "post_attention_layernorm.weight"
            gate_name, up_name = p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
            gate: Matmul | QuantizedMatmul
            up: Matmul | QuantizedMatmul
            gate_up: QuantizedMatmul | None = None
            gate_q, up_q = quantized.get(gate_name), quantized.get(up_name)
            if kernels is not None and gate_q is not None and up_q is not None and gate_q.kind == up_q.kind:
                fused = t(gate_name, up_name, norm=mlp_norm)  # (a QuantizedMatmul: one GGUF type)
                assert isinstance(fused, QuantizedMatmul)
                gate_up = fused
                gate, up = fused.split(gate_q.shape[0])
            else:
                gate, up = t(gate_name, norm=mlp_norm), t(up_name, norm=mlp_norm)
            self.layers.append(LayerWeights(
                qkv=t(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"), norm=attn_norm,
                      bias=config.qkv_bias),
                o=t(p + "self_attn.o_proj.weight", bias=config.o_bias),
                gate=gate,
                up=up,
                gate_up=gate_up,
                down=t(p + "mlp.down_proj.weight"),
                norm_bytes=(2 * config.hidden_size + config.qk_norm * 2 * config.head_dim)
                * torch.empty((), dtype=dtype).element_size(),
                qk_norm=qk_norm(p),
            ))
        self.norm_bytes = config.hidden_size * torch.empty((), dtype=dtype).element_size()
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                                    dtype, device)
        self.scale = config.head_dim ** -0.5

    @property
    def weight_bytes(self) -> int:
        matrices = [self.lm_head]
        norms = self.norm_bytes
        for layer in self.layers:
            matrices += [layer.qkv, layer.o, layer.gate, layer.up, layer.down]
            norms += layer.norm_bytes
        if isinstance(self.embed, BlockQuantized):
            # a tied lm_head kept in blocks reads the embedding's own blocks: held once
            embed = 0 if getattr(self.lm_head, "weight", None) is self.embed else self.embed.nbytes
        else:
            embed = self.embed.numel() * self.embed.element_size()
        return embed + norms + sum(m.nbytes for m in matrices)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor,
                layer_hook: LayerHook | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (the flattened batch); returns logits [len(logits_indices), vocab]."""
        c = self.config
        eps = c.rms_norm_eps * c.hidden_size
        if isinstance(self.embed, BlockQuantized):
            h = self.embed.rows(input_ids)  # [T, hidden]
        else:
            h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        cos, sin = self.rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv.normed(h, eps)  # [T, q_size + 2 * kv_size]
            qk = qkv[:, :c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.qk_norm is not None:
                qk = head_rms(qk, layer.qk_norm, c.rms_norm_eps)
            qk = self.rope.rotate(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, c.q_size + c.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            k_cache, v_cache = kv_cache.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            if layer_hook is not None:
                layer_hook(i)
            h = layer.o.add(attn.reshape(T, c.q_size), h)
            if layer.gate_up is not None:
                gated = layer.gate_up.swiglu(h, eps)
            else:
                x = unit_rms(h, eps)
                gated = layer.up.mul(x, layer.gate.silu(x))
            h = layer.down.add(gated, h)
        return self.lm_head.normed(h[logits_indices], eps).float()


def unit_rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight, scaled by 1/sqrt(hidden): h / sqrt(sum(h^2) + eps * hidden). The weight
    and the sqrt(hidden) live in the next matrices (see `LayerWeights`); `eps` comes pre-multiplied."""
    if h.dtype == torch.float32:
        inv: torch.Tensor = torch.linalg.vecdot(h, h).unsqueeze(-1).add_(eps).rsqrt_()
        return h * inv
    x = h.float()  # bf16/fp16: the sum of squares in float32, as HF does
    inv = torch.linalg.vecdot(x, x).unsqueeze(-1).add_(eps).rsqrt_()
    return (x * inv).to(h.dtype)


def head_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (each head's vector), in float32 as HF's, times `weight` (per head, dim)."""
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype)


def _present(present: Container[str], *names: str) -> tuple[str, ...]:
    """`names`, each checked to be among `present` (the checkpoint's tensor names)."""
    for n in names:
        if n not in present:
            raise ValueError(f"checkpoint is missing tensor {n!r}")
    return names
