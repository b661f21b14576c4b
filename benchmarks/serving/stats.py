"""Latency percentiles, SLO attainment and throughput from the client's records of one run.

Definitions, so the numbers can be argued with:

- Percentiles interpolate linearly between the closest ranks (numpy's default, Hyndman & Fan type 7).
- TTFT and end-to-end latency: one value per completed request. ITL: every gap between consecutive output
  tokens of every completed request, pooled (so long answers weigh more, as they do for a reader).
- A request meets the SLOs when it completed, its TTFT <= the TTFT SLO and its mean inter-token gap (its
  time per output token after the first, "TPOT" in DistServe and vLLM) <= the ITL SLO. Attainment is that
  count over the requests *sent*: a failed request misses.
- Throughput divides by the run's wall time: the first send to the last answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from benchmarks.serving.client import RequestRecord, RunResult

STAGES = ("queue", "prefill", "kv_transfer", "first_decode")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, interpolated linearly between closest ranks; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Percentiles(NamedTuple):
    """p50/p90/p99 of one latency, in seconds (NaN when there were no values)."""

    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(*(percentile(values, q) for q in (50, 90, 99)))


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # a request's time to first token
    itl_s: float  # a request's mean inter-token gap (TPOT)

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got ttft_s={self.ttft_s}, itl_s={self.itl_s}")

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        return r.mean_itl is None or r.mean_itl <= self.itl_s  # a 1-token answer has no gaps to miss


    def missed(self, r: RequestRecord, now: float) -> bool:
        """Already certain to miss at `now`: ended without meeting the SLOs, or its first token came (or
        is still not here) later than the TTFT SLO. An ITL miss is certain only once it ends."""
        if r.done_at is not None or r.error is not None:
            return not self.met_by(r)
        if r.ttft is not None:
            return r.ttft > self.ttft_s
        return r.sent_at > 0 and now - r.sent_at > self.ttft_s


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """The share of requests that met both SLOs (0.0 for no requests)."""
    return sum(slo.met_by(r) for r in records) / len(records) if records else 0.0


@dataclass(frozen=True)
class Summary:
    """One run's numbers (seconds, tokens, per second)."""

    num_sent: int
    num_completed: int
    num_failed: int  # sent and not completed: an error, or cancelled at the drain timeout
    num_output_tokens: int  # received, completed or not
    num_prompt_tokens: int  # of completed requests
    num_cached_prompt_tokens: int  # of those, served from a prefix cache (usage.cached_prompt_tokens)
    duration_s: float
    ttft: Percentiles
    itl: Percentiles
    e2e: Percentiles
    output_tokens_per_s: float
    requests_per_s: float  # completed requests per second
    slo_attainment: float
    # medians of the server's TTFT breakdown (`Timing` on the last message): queue, prefill, kv_transfer, ...
    stages_p50: dict[str, float]
    # completed requests by where their prompt was prefilled ("remote", "local"), and of those that hit a
    # prefix cache; empty where the server does not say (colocated, the HTTP door)
    placements: dict[str, int] = field(default_factory=dict)
    cache_hit_placements: dict[str, int] = field(default_factory=dict)
    # [TTFT, mean ITL] of every request sent (None: it failed, or had no gaps), so that attainment under
    # another SLO can be read back from the JSON without running again
    per_request: list[tuple[float | None, float | None]] = field(default_factory=list)

    @property
    def cached_share(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def to_dict(self) -> dict:
        """JSON-ready: NaN (no values to take a percentile of) becomes None."""
        d = asdict(self)
        for name in ("ttft", "itl", "e2e"):
            d[name] = {k: _finite(v) for k, v in getattr(self, name)._asdict().items()}
        d["cached_share"] = self.cached_share
        d["stages_p50"] = {k: _finite(v) for k, v in self.stages_p50.items()}
        return d


def _finite(v: float) -> float | None:
    return None if math.isnan(v) else v


def summarize(run: RunResult, slo: SLO) -> Summary:
    done = [r for r in run.records if r.ok]
    n_out = sum(r.num_output_tokens for r in run.records)
    return Summary(
        num_sent=len(run.records), num_completed=len(done), num_failed=len(run.records) - len(done),
        num_output_tokens=n_out, num_prompt_tokens=sum(r.num_prompt_tokens for r in done),
        num_cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done), duration_s=run.duration_s,
        ttft=Percentiles.of(ttfts(done)), itl=Percentiles.of(itls(done)),
        e2e=Percentiles.of([r.e2e for r in done]),
        output_tokens_per_s=n_out / run.duration_s, requests_per_s=len(done) / run.duration_s,
        slo_attainment=attainment(run.records, slo),
        stages_p50={k: percentile([r.stages[k] for r in done if k in r.stages], 50) for k in STAGES},
        placements=dict(Counter(r.placement for r in done if r.placement)),
        cache_hit_placements=dict(Counter(r.placement for r in done if r.placement and r.cached_prompt_tokens)),
        per_request=[(r.ttft, r.mean_itl) if r.ok else (None, None) for r in run.records])


def ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return [r.ttft for r in records if r.ok and r.ttft is not None]


def itls(records: Sequence[RequestRecord]) -> list[float]:
    return [g for r in records if r.ok for g in r.itls]
