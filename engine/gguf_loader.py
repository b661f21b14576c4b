"""Reading a GGUF file (llama.cpp's format) into an HF-named fp32 state dict and a ModelConfig.

Quantised tensors (Q4_1, Q8_0, ...) are dequantised with the `gguf` package. llama.cpp stores q_proj and
k_proj with their rows permuted for its interleaved RoPE; we undo that so the weights follow the HF
(rotate-half) convention that the rest of the engine and transformers use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig

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
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama)")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if meta("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("rope.dimension_count", hidden // heads),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # inverse of llama.cpp's convert permute: (heads, 2, d/2, in) <- (heads, d/2, 2, in)
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    config = gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        base, _, kind = t.name.rpartition(".")
        if base.startswith("blk."):
            _, layer, short = base.split(".", 2)
            if short not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            name = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{kind}"
        elif base in _GLOBAL_NAMES:
            name, short = f"{_GLOBAL_NAMES[base]}.{kind}", base
        else:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if short == "attn_q":
            w = _unpermute(w, config.num_heads)
        elif short == "attn_k":
            w = _unpermute(w, config.num_kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return config, state
