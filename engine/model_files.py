"""A checkpoint's shape without its weights: torch-free, so the serve process can read the limits it needs
(context length, vocabulary) from the model the workers will load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ModelConfig


def load_config(path: Path) -> ModelConfig:
    """The model's shape, from an HF directory's config.json or a .gguf file's metadata."""
    if path.suffix == ".gguf":
        return gguf_config(gguf_reader(path))
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def model_limits(path: Path, builtin: bool = False) -> tuple[int, int]:
    """(context length, vocabulary size) of any model family's checkpoint: what the doors validate against.
    `builtin`: as the built-in engine reads it (`load_config`: one of `engine.config.FAMILIES`, else a
    ValueError naming the cause; a sliding window caps the context); vLLM serves every family."""
    if builtin or path.suffix == ".gguf":
        config = load_config(path)
        return config.max_position_embeddings, config.vocab_size
    d = hf_text_config(path)
    return int(d.get("max_position_embeddings", 2048)), int(d["vocab_size"])


def hf_text_config(path: Path) -> dict[str, Any]:
    """An HF directory's config.json, its language model's part (multimodal configs nest it)."""
    d = json.loads((path / "config.json").read_text())
    return dict(d.get("text_config", d))


def kv_heads(text_config: dict[str, Any]) -> int:
    """The KV heads of an HF config (`hf_text_config`): its query heads when it names no other count."""
    return int(text_config.get("num_key_value_heads") or text_config["num_attention_heads"])


def tensor_parallel_refusal(path: Path, tp_size: int) -> str | None:
    """Why the attention of the model at `path` (an HF directory) cannot split over `tp_size` ranks as vLLM
    splits it (its query heads by the ranks; its KV heads by the ranks, or the ranks by its KV heads when
    there are fewer), naming the sizes that can; None when it can."""
    d = hf_text_config(path)
    query, kv = int(d["num_attention_heads"]), kv_heads(d)

    def splits(n: int) -> bool:
        return query % n == 0 and (kv % n == 0 if n <= kv else n % kv == 0)

    if splits(tp_size):
        return None
    sizes = ", ".join(str(n) for n in range(1, query + 1) if splits(n))
    return (f"its {query} query heads and {kv} KV heads do not split over {tp_size} ranks "
            f"(sizes that do: {sizes})")


def gguf_reader(path: Path | str) -> Any:
    """`gguf.GGUFReader(path)`, with its views taken from a plain array over the file's memory map.

    NOTE: the reader makes a numpy view per metadata item, and a view of an `np.memmap` costs a Python-level
    `__array_finalize__` each: SmolLM2's 98k vocabulary and merge strings took 2.6 s of every worker start,
    0.7 s over plain views (the same bytes, the same map; `tests/engine/test_model_vs_hf.py` checks every
    field and tensor against the stock reader's)."""
    import numpy as np
    from gguf import GGUFReader

    class _PlainViewReader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            if "_plain" not in self.__dict__:
                self._plain = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            arr = self._plain[offset:offset + dt.itemsize * int(count)].view(dt)[:int(count)]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return _PlainViewReader(path)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # llama.cpp's names; its Mistral files are "llama"


def gguf_config(reader: Any) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served by the built-in engine (it serves "
                         f"{', '.join(GGUF_ARCHITECTURES)}); serve the model's HF directory with "
                         "`--engine vllm`")

    def meta(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    scaling: dict[str, Any] | None = None
    kind = meta("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    elif kind not in (None, "none"):  # (YaRN: wrong at every length if ignored)
        raise ValueError(f"GGUF rope scaling {kind!r} is not computed by the built-in engine (it computes "
                         "linear and Llama 3.1's); serve the model's HF directory with `--engine vllm`")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1's scaling as llama.cpp writes it: a divisor per frequency
        if scaling is not None:
            raise ValueError("a GGUF file with both rope_freqs and a rope scaling type: not served")
        from gguf.quants import dequantize

        factors = dequantize(freqs.data, freqs.tensor_type).astype("float32").ravel()
        scaling = {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        # (Qwen3's heads are wider than hidden / heads; llama.cpp writes that as the key length)
        head_dim=meta("attention.key_length") or meta("rope.dimension_count", hidden // heads),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
