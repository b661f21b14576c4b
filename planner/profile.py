"""A profile: the constants the simulator prices every engine step, KV transfer and router hop with.

    prefill step (s)  = prefill.step_s + prefill.token_s * tokens + prefill.attention_s * sum(chunk * context)
    decode step (s)   = decode.step_s + decode.seq_s * batch + decode.context_token_s * batch's total context
    colocated step    = the decode step of its rows + the prefill terms of its prompt chunks
    KV transfer (s)   = transfer.latency_s + bytes / transfer.bytes_per_s      (per chunk, a link at a time)
    TTFT adds router.request_s; each token relayed adds router.token_s of router time (reported, see docs)

`chunk * context` is attention's pairwise work: each prompt token of a chunk attends to the tokens before
it (the chunk's own half on average), so long prompts cost more per token than short ones.

One JSON file, versioned (`VERSION`), naming the machine, model and date it was measured on;
`planner.devices` derives one for another device from published figures (its `source` says so).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
LONG_INTERFERENCE_TOKENS = 1280  # the prompt `interference` is measured with (`planner.profiler`)


def _positive(obj: object, *names: str, allow_zero: bool = True) -> None:
    for name in names:
        v = getattr(obj, name)
        if v < 0 or (not allow_zero and v == 0):
            raise ValueError(f"{type(obj).__name__}.{name} must be {'>=' if allow_zero else '>'} 0, got {v}")


@dataclass(frozen=True)
class PrefillCost:
    """A prefill (or colocated) worker's step, by the prompt tokens it computes."""

    step_s: float  # fixed cost of a step (scheduling, the model's launch overheads)
    token_s: float  # per prompt token computed (the MLPs and projections)
    attention_s: float = 0.0  # per (prompt token x token it attends to)

    def __post_init__(self) -> None:
        _positive(self, "step_s", "attention_s")
        _positive(self, "token_s", allow_zero=False)

    def chunk_s(self, tokens: int, context: int) -> float:
        """What computing `tokens` prompt tokens after `context` already computed adds to a step."""
        return self.token_s * tokens + self.attention_s * tokens * (context + tokens / 2)


@dataclass(frozen=True)
class DecodeCost:
    """A decode step, by the sequences in the batch and the context they attend to."""

    step_s: float  # a step at batch 0 (the fitted line's intercept)
    seq_s: float  # per sequence in the batch
    context_token_s: float = 0.0  # per token of context summed over the batch

    def __post_init__(self) -> None:
        _positive(self, "step_s", "seq_s", "context_token_s")

    def step(self, batch: int, context_tokens: int) -> float:
        return self.step_s + self.seq_s * batch + self.context_token_s * context_tokens


@dataclass(frozen=True)
class TransferCost:
    """Moving a prompt's KV from its prefill worker to its decode worker."""

    bytes_per_token: int  # KV bytes a token takes on the wire (every layer, K and V)
    bytes_per_s: float  # a link's rate
    latency_s: float = 0.0  # per transfer (per chunk pushed)

    def __post_init__(self) -> None:
        _positive(self, "bytes_per_token", "bytes_per_s", allow_zero=False)
        _positive(self, "latency_s")

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class RouterCost:
    """The router's own share of what a client sees."""

    request_s: float = 0.0  # added to every TTFT: admission, placement, the first token's relay
    token_s: float = 0.0  # router time per token relayed (what one router can carry: 1 / token_s tokens/s)

    def __post_init__(self) -> None:
        _positive(self, "request_s", "token_s")


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings the profile was taken with (the simulator schedules steps by them)."""

    block_size: int = 16
    prefill_chunk_tokens: int = 256  # all prompts of a step together (fair order)
    aging_tokens_per_step: int = 64  # a waiting prompt's credit per step it waited (fair order)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    num_blocks: int = 4096  # KV blocks per worker

    def __post_init__(self) -> None:
        _positive(self, "block_size", "prefill_chunk_tokens", "max_num_batched_tokens", "max_num_seqs",
                  "num_blocks", allow_zero=False)
        _positive(self, "aging_tokens_per_step")


@dataclass(frozen=True)
class Profile:
    """Everything the simulator needs about one (machine, model) pair."""

    model: str
    machine: dict[str, Any]  # where it was measured: host, cpu, cores, device
    date: str  # ISO 8601, UTC
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    router: RouterCost = RouterCost()
    engine: EngineSettings = EngineSettings()
    # the cores the workers share, when fewer than the workers (a CPU box): the simulator slows each step by
    # the share of cores it gets; None: every worker has a device of its own (GPUs)
    shared_cores: float | None = None
    # on a shared machine, what each other worker computing at the same time adds to a step (a fraction:
    # memory bandwidth and caches are shared even when cores are not); 0 with a device each
    interference: float = 0.0
    # the same for a short prefill, (its prompt tokens, stretch): bound by reading the weights as a decode
    # step is, it loses more to a decoding neighbour than a long, compute-bound one; between the two lengths
    # the stretch is interpolated on log(tokens) (`interference_at`). None: `interference` at every length
    short_interference: tuple[int, float] | None = None
    source: str = "measured"  # or how it was derived ("scaled from ... by ...")
    samples: dict[str, Any] = field(default_factory=dict)  # the raw measurements the constants were fitted to
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.version != VERSION:
            raise ValueError(f"profile version {self.version} is not {VERSION}: take the profile again")
        if self.interference < 0:
            raise ValueError(f"interference must be >= 0, got {self.interference}")
        if self.short_interference is not None:
            tokens, stretch = self.short_interference
            if tokens < 1 or stretch < 0:
                raise ValueError(f"short_interference must be (tokens >= 1, stretch >= 0), got "
                                 f"{self.short_interference}")
            object.__setattr__(self, "short_interference", (int(tokens), float(stretch)))  # (JSON: a list)
        if self.shared_cores is not None and not self.shared_cores > 0:
            raise ValueError(f"shared_cores must be > 0 or null, got {self.shared_cores}")

    def interference_at(self, prompt_tokens: int) -> float:
        """The stretch each other computing worker adds to a prefill of `prompt_tokens` (`interference` for
        a long one; see `short_interference`)."""
        if self.short_interference is None:
            return self.interference
        short, stretch = self.short_interference
        if prompt_tokens <= short:
            return stretch
        if prompt_tokens >= LONG_INTERFERENCE_TOKENS:
            return self.interference
        x = math.log(prompt_tokens / short) / math.log(LONG_INTERFERENCE_TOKENS / short)
        return stretch + x * (self.interference - stretch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        try:
            parts = {"prefill": PrefillCost(**d["prefill"]), "decode": DecodeCost(**d["decode"]),
                     "transfer": TransferCost(**d["transfer"]), "router": RouterCost(**d.get("router", {})),
                     "engine": EngineSettings(**d.get("engine", {}))}
            rest = {k: v for k, v in d.items() if k not in parts}
            return cls(**parts, **rest)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pdserve profile: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a profile: {e}") from e
        return cls.from_dict(d)


def machine_info() -> dict[str, Any]:
    import os

    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
