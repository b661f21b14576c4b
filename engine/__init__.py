"""pdserve's model runtime, shared by the prefill and decode workers (and the offline API).

NOTE: the exports load lazily, so the router can import `engine.sampling_params` or `engine.tokenizer`
without pulling in torch and the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "EngineBackend": "engine.backend",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
}
__all__ = ["LLM", "LLMEngine", "EngineBackend", "RequestOutput", "SamplingParams", "EngineConfig",
           "ModelConfig", "CacheConfig", "SchedulerConfig"]

if TYPE_CHECKING:
    from engine.backend import EngineBackend
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLM, LLMEngine, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
