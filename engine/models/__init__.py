"""Model definitions over the paged KV cache."""

from engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
