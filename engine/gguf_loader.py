"""Reading a GGUF file (llama.cpp's format) into an HF-named fp32 state dict and a ModelConfig.

Quantised tensors (Q4_1, Q8_0, ...) are dequantised with the `gguf` package. In its "llama" files llama.cpp
stores q_proj and k_proj with their rows permuted for its interleaved RoPE; we undo that so the weights
follow the HF (rotate-half) convention that the rest of the engine and transformers use. Its Qwen2 and
Qwen3 files keep HF's order.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model_files import gguf_config, gguf_field

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # inverse of llama.cpp's convert permute: (heads, 2, d/2, in) <- (heads, d/2, 2, in)
    out_dim = w.shape[0]
    out: np.ndarray = w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    config = gguf_config(reader)
    permuted = gguf_field(reader, "general.architecture") == "llama"
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if base.startswith("blk."):
            _, layer, short = base.split(".", 2)
            if short not in _LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{kind}"
        elif base in _GLOBAL_NAMES:
            name, short = f"{_GLOBAL_NAMES[base]}.{kind}", base
        else:
            continue  # (rope_freqs: the config's rope scaling, `gguf_config`)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and short == "attn_q":
            w = _unpermute(w, config.num_heads)
        elif permuted and short == "attn_k":
            w = _unpermute(w, config.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return config, state
