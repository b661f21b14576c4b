"""pdserve's model runtime, shared by the prefill and decode workers (and the offline API)."""

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLM, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "EngineConfig", "ModelConfig",
           "CacheConfig", "SchedulerConfig"]
