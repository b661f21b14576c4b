"""Reading a GGUF file (llama.cpp's format) into an HF-named fp32 state dict and a ModelConfig.

Quantised tensors (Q4_1, Q8_0, ...) are dequantised with the `gguf` package. In its "llama" files llama.cpp
stores q_proj and k_proj with their rows permuted for its interleaved RoPE; we undo that so the weights
follow the HF (rotate-half) convention that the rest of the engine and transformers use. Its Qwen2 and
Qwen3 files keep HF's order.

`load_gguf_quantized` keeps Q4_0, Q4_1 and Q8_0 matrices in their blocks (`engine.quant`), permuted the
same way.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model_files import gguf_config, gguf_field, gguf_reader
from engine.quant import KINDS, BlockQuantized, Q4_0Overflow

logger = logging.getLogger(__name__)

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
    """Every tensor dequantised to float32."""
    config, state, _ = _read(path, keep_quantized=False)
    return config, state


def load_gguf_quantized(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockQuantized]]:
    """Q4_0, Q4_1 and Q8_0 matrices kept in their blocks (the third dict), every other tensor in float32."""
    return _read(path, keep_quantized=True)


def _read(path: str, keep_quantized: bool,
          ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockQuantized]]:
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    config = gguf_config(reader)
    permuted = gguf_field(reader, "general.architecture") == "llama"
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, BlockQuantized] = {}
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
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(short) if permuted else None
        if keep_quantized and t.tensor_type.name in KINDS and len(t.shape) == 2:
            try:
                b = BlockQuantized.from_gguf(t.tensor_type.name, np.asarray(t.data), int(t.shape[1]))
            except Q4_0Overflow as e:  # this one matrix is dequantised: 6.4x its bytes, said aloud
                logger.warning("%s is read as float32, not in its blocks: %s", t.name, e)
            else:
                if heads is not None:
                    b = b.map_rows(functools.partial(_unpermute, n_heads=heads))
                blocks[name] = b
                continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if heads is not None:
            w = _unpermute(w, heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return config, state, blocks
