"""Workloads: request shapes named after real traffic, scaled to SmolLM2-135M on a couple of CPU cores.

Every prompt is a list of token ids drawn uniformly from the model's vocabulary (clear of the special ids
at its start) by a `random.Random` seeded with the workload's name and the run's seed: the same seed gives
the same requests, token for token, in every process. Output lengths are exact: the client sends
`ignore_eos=True` with `max_tokens` = the drawn output length.

Lengths are uniform over closed ranges. At about 700 prompt tokens/s and 20-50 ms per decode step for a
1-thread SmolLM2-135M worker on this class of CPU, the defaults put a `chat` request at ~0.2 s of prefill
and ~3 s of decode, a `rag` request at ~1.5 s of prefill and <1 s of decode. Scale them up for GPUs.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# the lowest prompt token id drawn: SmolLM2 keeps its special tokens in ids 0-16; tiny-random's byte
# vocabulary has none below 256, but staying clear of small ids costs nothing
FIRST_TOKEN_ID = 100


class Vocab(NamedTuple):
    """The token ids prompts draw from: [low, high)."""

    low: int
    high: int

    @classmethod
    def for_model(cls, vocab_size: int) -> Vocab:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        return cls(min(FIRST_TOKEN_ID, vocab_size // 4), vocab_size)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt and exactly how many tokens it must produce."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # what part of the workload it is ("chat", "long", "agent-3", ...): for per-kind breakdowns

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


LengthRange = tuple[int, int]  # inclusive


def _check_range(name: str, r: LengthRange) -> None:
    if not 1 <= r[0] <= r[1]:
        raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {r}")


def _draw(rng: random.Random, r: LengthRange) -> int:
    return rng.randint(r[0], r[1])


def _tokens(rng: random.Random, n: int, vocab: Vocab) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab.low, vocab.high) for _ in range(n))


class Workload(ABC):
    """A reproducible stream of requests. Subclasses are frozen dataclasses of their length ranges."""

    name: str

    @abstractmethod
    def _generate(self, n: int, rng: random.Random, vocab: Vocab) -> list[RequestSpec]: ...

    @property
    @abstractmethod
    def max_total_len(self) -> int:
        """The longest prompt + output any request of this workload can have."""

    def requests(self, n: int, seed: int, vocab: Vocab) -> list[RequestSpec]:
        """The first `n` requests for `seed`; a prefix of the list for any larger `n`."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        # NOTE: a str seed is hashed with sha512 by `random.seed` (version 2), so this is stable across
        # processes, unlike hash() of a tuple under PYTHONHASHSEED.
        return self._generate(n, random.Random(f"{self.name}/{seed}"), vocab)

    def check_fits(self, max_model_len: int) -> None:
        if self.max_total_len > max_model_len:
            raise ValueError(f"workload {self.name!r}: requests reach {self.max_total_len} tokens (prompt + "
                             f"output) but the server's max_model_len is {max_model_len}")


@dataclass(frozen=True)
class Shaped(Workload):
    """Independent requests with prompt and output lengths drawn from two ranges."""

    name: str
    prompt_len: LengthRange
    output_len: LengthRange

    def __post_init__(self) -> None:
        _check_range("prompt_len", self.prompt_len)
        _check_range("output_len", self.output_len)

    @property
    def max_total_len(self) -> int:
        return self.prompt_len[1] + self.output_len[1]

    def _generate(self, n: int, rng: random.Random, vocab: Vocab) -> list[RequestSpec]:
        out = []
        for _ in range(n):
            p, o = _draw(rng, self.prompt_len), _draw(rng, self.output_len)
            out.append(RequestSpec(_tokens(rng, p, vocab), o, self.name))
        return out


def chat() -> Shaped:
    """Short prompt, longer answer: decode-heavy, ITL-bound."""
    return Shaped("chat", prompt_len=(64, 192), output_len=(64, 160))


def rag() -> Shaped:
    """Long prompt (retrieved documents), short answer: prefill-heavy, TTFT-bound."""
    return Shaped("rag", prompt_len=(768, 1280), output_len=(16, 48))


@dataclass(frozen=True)
class Burst(Workload):
    """Steady chat streams plus periodic long prompts: every `long_every`-th request (the 1st, the
    (long_every+1)-th, ...) is a long prompt with a short answer, the others are `chat`.

    Under a closed loop of concurrency C the chat streams keep ~C sequences decoding while each long prompt
    lands among them; under Poisson arrivals the long prompts come every `long_every / rate` seconds on
    average. Every colocated worker that takes a long prompt stalls its decoding streams for the prompt's
    prefill chunks; a decode worker never computes a prompt.
    """

    name: str = "burst"
    # the steady traffic between long prompts: chat, with answers a little shorter so that a run of a
    # minute holds enough long prompts for their stalls to reach the ITL p99
    streams: Shaped = Shaped("chat", prompt_len=(64, 192), output_len=(32, 96))
    long_every: int = 4
    long_prompt_len: LengthRange = (1024, 1024)
    long_output_len: LengthRange = (16, 16)

    def __post_init__(self) -> None:
        if self.long_every < 1:
            raise ValueError(f"long_every must be >= 1, got {self.long_every}")
        _check_range("long_prompt_len", self.long_prompt_len)
        _check_range("long_output_len", self.long_output_len)

    @property
    def max_total_len(self) -> int:
        return max(self.streams.max_total_len, self.long_prompt_len[1] + self.long_output_len[1])

    def _generate(self, n: int, rng: random.Random, vocab: Vocab) -> list[RequestSpec]:
        out = []
        for i in range(n):
            if i % self.long_every == 0:
                p, o = _draw(rng, self.long_prompt_len), _draw(rng, self.long_output_len)
                out.append(RequestSpec(_tokens(rng, p, vocab), o, "long"))
            else:
                p, o = _draw(rng, self.streams.prompt_len), _draw(rng, self.streams.output_len)
                out.append(RequestSpec(_tokens(rng, p, vocab), o, self.streams.name))
        return out


@dataclass(frozen=True)
class Agent(Workload):
    """`sessions` agents, each resending its own long prefix (system prompt, tool definitions, the task so
    far) with a new tail (the latest tool result) every turn, and answering briefly (the next tool call).

    Requests come turn-major: turn 0 of every session, then turn 1 of every session, ... — a fleet of agents
    progressing at the same pace. The sessions' prefixes together are meant to overflow one prefill
    worker's KV cache while half of them fit (size the cache with `--num-blocks`): routing each session to
    the worker that holds its prefix then hits the cache every turn, while blind round-robin makes every
    worker cycle through every prefix, which evicts each one (LRU) before it comes round again.
    Keep `sessions` odd with 2 prefill workers, or round-robin's alternation would partition the sessions
    by accident.
    """

    name: str = "agent"
    sessions: int = 5
    prefix_len: int = 1024
    tail_len: LengthRange = (32, 64)
    output_len: LengthRange = (16, 32)

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")
        if self.prefix_len < 1:
            raise ValueError(f"prefix_len must be >= 1, got {self.prefix_len}")
        _check_range("tail_len", self.tail_len)
        _check_range("output_len", self.output_len)

    @property
    def max_total_len(self) -> int:
        return self.prefix_len + self.tail_len[1] + self.output_len[1]

    def _generate(self, n: int, rng: random.Random, vocab: Vocab) -> list[RequestSpec]:
        prefixes = [_tokens(rng, self.prefix_len, vocab) for _ in range(self.sessions)]
        out = []
        for i in range(n):
            s = i % self.sessions
            tail = _tokens(rng, _draw(rng, self.tail_len), vocab)
            out.append(RequestSpec(prefixes[s] + tail, _draw(rng, self.output_len), f"agent-{s}"))
        return out


@dataclass(frozen=True)
class Jsonl(Workload):
    """Lengths from a file, one JSON object a line: `{"prompt_len": 812, "output_len": 64}` (an optional
    `"kind"` labels the line). Requests follow the file's order, wrapping around when more are asked for."""

    path: str
    shapes: tuple[tuple[int, int, str], ...]
    name: str = "jsonl"

    @classmethod
    def load(cls, path: str | Path) -> Jsonl:
        shapes = []
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                p, o = int(d["prompt_len"]), int(d["output_len"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt_len\": N, \"output_len\": M}}, "
                                 f"got {line.strip()[:80]!r} ({e})") from e
            if p < 1 or o < 1:
                raise ValueError(f"{path}:{lineno}: prompt_len and output_len must be >= 1, got {p}, {o}")
            shapes.append((p, o, str(d.get("kind", "jsonl"))))
        if not shapes:
            raise ValueError(f"{path}: no requests in the file")
        return cls(str(path), tuple(shapes), name=Path(path).stem)

    @property
    def max_total_len(self) -> int:
        return max(p + o for p, o, _ in self.shapes)

    def _generate(self, n: int, rng: random.Random, vocab: Vocab) -> list[RequestSpec]:
        return [RequestSpec(_tokens(rng, p, vocab), o, kind)
                for p, o, kind in (self.shapes[i % len(self.shapes)] for i in range(n))]


BUILTIN = {"chat": chat, "rag": rag, "agent": Agent, "burst": Burst}


def make_workload(name: str) -> Workload:
    """A built-in workload by name, or a JSONL file of lengths by path."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if name.endswith(".jsonl") or Path(name).is_file():
        return Jsonl.load(name)
    raise ValueError(f"workload must be one of {', '.join(BUILTIN)} or a .jsonl file, got {name!r}")
