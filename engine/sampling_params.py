"""Per-request sampling settings, in the shape vLLM users know."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 -> no top-k
    seed: int | None = None  # same seed, same prompt -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # opt out of speculative decoding on an engine that has it on (the output is the same either way;
    # this only trades the engine's extra verify work for this request)
    disable_speculation: bool = False
    # mixed into the prompt's block hashes (the prefix cache's keys): prompts match cached blocks only under
    # the same salt, so tenants with different salts never share (or learn of) each other's cached prefixes
    cache_salt: str = ""
    # the request's priority class (higher first): in fair prefill order, prompts of a higher class are
    # computed before any of a lower one (aging orders prompts within a class)
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
