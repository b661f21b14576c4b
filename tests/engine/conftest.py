"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' SmolLM2 from the same GGUF, the independent reference (loaded once: ~15 s)."""
    from transformers import AutoModelForCausalLM

    from engine.hub import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    # NOTE: transformers dequantises and un-permutes the GGUF itself, independently of engine.gguf_loader.
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()
