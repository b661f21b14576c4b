"""Writing a built-in model's HF directory (torch, transformers, safetensors): `engine.hub` runs this as
`python -m engine.checkpoint {smollm2 OUT GGUF | tiny-random OUT}` on first use, under its lock."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.hub import TINY_CHAT_TEMPLATE, TINY_RANDOM_CONFIG


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights, scaled so logits are well separated (greedy ties would make tests flaky)."""
    g = torch.Generator().manual_seed(seed)
    H, inter = config.hidden_size, config.intermediate_size

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g).div(float(in_f ** 0.5))

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(H, generator=g)

    s = {"model.embed_tokens.weight": torch.randn(config.vocab_size, H, generator=g), "model.norm.weight": norm()}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = norm()
        s[p + "post_attention_layernorm.weight"] = norm()
        s[p + "self_attn.q_proj.weight"] = lin(config.q_size, H)
        s[p + "self_attn.k_proj.weight"] = lin(config.kv_size, H)
        s[p + "self_attn.v_proj.weight"] = lin(config.kv_size, H)
        s[p + "self_attn.o_proj.weight"] = lin(H, config.q_size)
        s[p + "mlp.gate_proj.weight"] = lin(inter, H)
        s[p + "mlp.up_proj.weight"] = lin(inter, H)
        s[p + "mlp.down_proj.weight"] = lin(H, inter)
        if config.qkv_bias:
            for x, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
                s[p + f"self_attn.{x}_proj.bias"] = 0.1 * torch.randn(size, generator=g)
        if config.o_bias:
            s[p + "self_attn.o_proj.bias"] = 0.1 * torch.randn(H, generator=g)
        if config.qk_norm:
            for x in "qk":
                s[p + f"self_attn.{x}_norm.weight"] = 1.0 + 0.1 * torch.randn(config.head_dim, generator=g)
    if not config.tie_word_embeddings:
        s["lm_head.weight"] = lin(config.vocab_size, H) * 4.0
    return s


def byte_tokenizer(chat_template: str) -> Any:
    """A byte-level tokenizer: ids 0-255 are bytes, 256 = <s>, 257 = </s>; any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_to_char))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")  # type: ignore[no-untyped-call]
    fast.chat_template = chat_template
    return fast


def write_checkpoint(out: Path, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Any) -> None:
    """Write an HF model directory atomically (a half-written cache must never look complete)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        tokenizer.save_pretrained(str(tmp))
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_smollm2(gguf: Path, out: Path) -> None:
    """The SmolLM2 GGUF, dequantised, as an HF directory."""
    from transformers import AutoTokenizer

    from engine.gguf_loader import load_gguf

    config, state = load_gguf(str(gguf))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    write_checkpoint(out, config, state, tokenizer)


def write_tiny_random(out: Path) -> None:
    write_checkpoint(out, TINY_RANDOM_CONFIG, random_state_dict(TINY_RANDOM_CONFIG), byte_tokenizer(TINY_CHAT_TEMPLATE))


def main(argv: list[str]) -> None:
    what, out, *rest = argv
    if what == "smollm2":
        convert_smollm2(Path(rest[0]), Path(out))
    elif what == "tiny-random":
        write_tiny_random(Path(out))
    else:
        raise SystemExit(f"unknown built-in model {what!r} (smollm2, tiny-random)")


if __name__ == "__main__":
    main(sys.argv[1:])
