"""Loading a checkpoint: an HF directory (config.json + *.safetensors) or a .gguf file."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model_files import load_config

__all__ = ["load_checkpoint", "load_config"]


def load_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    if path.suffix == ".gguf":
        from engine.gguf_loader import load_gguf

        return load_gguf(str(path))
    from safetensors.torch import load_file

    config = load_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return config, state
