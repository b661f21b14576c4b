"""The requests a simulation serves: when each arrives, how long its prompt and answer are, and what prefix
it shares with others (which the prefix cache and placement see).

From `pdserve bench`'s workloads at a Poisson rate (the same requests and arrival times `pdserve bench
--rate R --seed S --rounds 1` sends), or from a `.jsonl` file, one request a line:

    {"arrival_s": 0.42, "prompt_len": 812, "output_len": 64, "prefix_id": "sys-1", "prefix_len": 512}

(`prefix_id`/`prefix_len` optional: requests with the same id share their first `prefix_len` tokens.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving.load import poisson_offsets
from benchmarks.serving.workloads import Agent, Vocab, make_workload
from protocol.block_hash import BlockHash, hash_blocks

# the vocabulary the bench draws prompts from (SmolLM2's): only prefixes are hashed, so any will do
TRACE_VOCAB = Vocab.for_model(49152)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds from the trace's start
    prompt_len: int
    output_len: int  # exact (the bench sets ignore_eos)
    prefix_id: str = ""  # requests with the same id share their first prefix_len prompt tokens ("": none)
    prefix_len: int = 0
    kind: str = ""  # what part of the workload it is, for per-kind breakdowns

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got {self.prompt_len}, {self.output_len}")
        if not 0 <= self.prefix_len <= self.prompt_len:
            raise ValueError(f"prefix_len must be in [0, prompt_len], got {self.prefix_len}")


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order, and what they came from."""

    requests: tuple[TraceRequest, ...]
    name: str

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"trace {self.name!r} has no requests")
        times = [r.arrival_s for r in self.requests]
        if times != sorted(times):
            raise ValueError(f"trace {self.name!r}: requests must be in arrival order")

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s

    @property
    def rate(self) -> float:
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else float("inf")

    def at_rate(self, rate: float) -> Trace:
        """The same requests with their arrival gaps scaled so they come at `rate` per second on average."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        k = self.rate / rate if self.duration_s > 0 else 1.0
        return Trace(tuple(_at(r, r.arrival_s * k) for r in self.requests), f"{self.name}@{rate:g}")


def _at(r: TraceRequest, t: float) -> TraceRequest:
    return TraceRequest(t, r.prompt_len, r.output_len, r.prefix_id, r.prefix_len, r.kind)


def from_workload(name: str, rate: float, num_requests: int, seed: int = 0) -> Trace:
    """A bench workload's first `num_requests` requests at Poisson `rate`: `pdserve bench`'s requests and
    arrivals for `--workload name --rate rate --num-requests n --seed seed --rounds 1`."""
    workload = make_workload(name)
    specs = workload.requests(num_requests, seed, TRACE_VOCAB)
    arrivals = poisson_offsets(num_requests, rate, seed)
    prefix = workload.prefix_len if isinstance(workload, Agent) else 0
    return Trace(tuple(TraceRequest(t, s.num_prompt_tokens, s.max_tokens, s.kind if prefix else "", prefix, s.kind)
                       for t, s in zip(arrivals, specs)), f"{workload.name}@{rate:g}")


def from_jsonl(path: str | Path) -> Trace:
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(TraceRequest(float(d["arrival_s"]), int(d["prompt_len"]), int(d["output_len"]),
                                    str(d.get("prefix_id", "")), int(d.get("prefix_len", 0)),
                                    str(d.get("kind", ""))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: expected {{\"arrival_s\", \"prompt_len\", \"output_len\"[, "
                             f"\"prefix_id\", \"prefix_len\"]}}: {e}") from e
    return Trace(tuple(sorted(out, key=lambda r: r.arrival_s)), Path(path).stem)


def _has_arrivals(path: str) -> bool:
    """A trace file (arrival times) rather than a bench workload file (lengths only)."""
    with open(path) as f:
        first = next((line for line in f if line.strip()), "{}")
    try:
        return "arrival_s" in json.loads(first)
    except json.JSONDecodeError:
        return True  # from_jsonl names the line


def load_trace(spec: str, rate: float | None, num_requests: int, seed: int = 0) -> Trace:
    """A `.jsonl` trace (rescaled to `rate` when one is given), or a bench workload (a name, or a `.jsonl`
    of lengths only, as `pdserve bench --workload` takes) at Poisson `rate`."""
    if spec.endswith(".jsonl") and _has_arrivals(spec):
        trace = from_jsonl(spec)
        return trace.at_rate(rate) if rate is not None else trace
    if rate is None:
        raise ValueError(f"workload {spec!r} needs --rate (a .jsonl trace carries its own arrival times)")
    return from_workload(spec, rate, num_requests, seed)


class PrefixHashes:
    """The block hashes of each shared prefix, drawn once per prefix id (a prompt's own tail never matches
    another's, so only its prefix's blocks are hashed)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_id: dict[str, list[BlockHash]] = {}

    def of(self, r: TraceRequest) -> Sequence[BlockHash]:
        if not r.prefix_id or r.prefix_len < self.block_size:
            return ()
        hashes = self._by_id.get(r.prefix_id)
        if hashes is None or len(hashes) < r.prefix_len // self.block_size:
            rng = random.Random(f"prefix/{r.prefix_id}")
            tokens = [rng.randrange(TRACE_VOCAB.low, TRACE_VOCAB.high) for _ in range(r.prefix_len)]
            hashes = self._by_id[r.prefix_id] = hash_blocks(tokens, self.block_size)
        return hashes[:r.prefix_len // self.block_size]
