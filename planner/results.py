"""What a simulation predicts: per-request TTFT and mean ITL, pooled ITL, SLO attainment, goodput and each
worker's utilisation, summarised the way `pdserve bench` summarises a real run (the same percentile rule,
the same SLO rule: TTFT at most the target and the request's *mean* gap at most the ITL target)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


def weighted_percentile(pairs: Sequence[tuple[float, int]], q: float) -> float:
    """The `q`-th percentile of values given as (value, count): the same as `pdserve bench`'s percentile
    (linear between closest ranks) of the list with each value repeated count times; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(p for p in pairs if p[1] > 0)
    if not xs:
        return math.nan
    ends, total = [], 0
    for _, n in xs:
        total += n
        ends.append(total)  # ranks [total - n, total) hold this value

    def at(rank: int) -> float:
        return xs[bisect.bisect_right(ends, rank)][0]

    pos = (total - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, total - 1)
    return at(lo) + (at(hi) - at(lo)) * (pos - lo)


class Percentiles(NamedTuple):
    """p50/p90/p99 in seconds (NaN when there were none)."""

    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, pairs: Sequence[tuple[float, int]]) -> Percentiles:
        return cls(*(weighted_percentile(pairs, q) for q in (50, 90, 99)))


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # a request's time to first token
    itl_s: float  # a request's mean inter-token gap (TPOT)
    target: float = 0.9  # the share of requests that must meet both

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLOs must be > 0 s, got ttft_s={self.ttft_s}, itl_s={self.itl_s}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")

    def with_margin(self, margin: float) -> SLO:
        """The bounds less `margin` (0.15: 15% tighter), to size against. A machine whose speed drifts by 10%
        between one run and the next (this repo's VM did) turns a plan that just meets a bound into a coin
        toss; a margin buys the headroom a measured run needs."""
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        return SLO(self.ttft_s * (1 - margin), self.itl_s * (1 - margin), self.target)


@dataclass(frozen=True)
class RequestResult:
    """One simulated request as a client would have seen it."""

    index: int
    kind: str
    ttft_s: float | None  # None: it never got its first token within the simulated time
    mean_itl_s: float | None  # None: a one-token answer, or unfinished
    e2e_s: float | None  # None: unfinished

    def meets(self, slo: SLO) -> bool:
        if self.e2e_s is None or self.ttft_s is None or self.ttft_s > slo.ttft_s:
            return False
        return self.mean_itl_s is None or self.mean_itl_s <= slo.itl_s


@dataclass(frozen=True)
class SimResult:
    """A simulation's prediction for one (layout, trace)."""

    layout: str
    trace: str
    requests: tuple[RequestResult, ...]
    itl_gaps: tuple[tuple[float, int], ...]  # every inter-token gap, pooled: (seconds, how many)
    duration_s: float  # the first arrival to the last token
    utilisation: dict[str, float]  # by worker: the share of the run it spent in steps
    router_tokens_per_s: float  # tokens the router relayed per second (its load)

    @property
    def ttft(self) -> Percentiles:
        return Percentiles.of([(r.ttft_s, 1) for r in self.requests if r.ttft_s is not None])

    @property
    def itl(self) -> Percentiles:
        return Percentiles.of(self.itl_gaps)

    @property
    def num_completed(self) -> int:
        return sum(r.e2e_s is not None for r in self.requests)

    def attainment(self, slo: SLO) -> float:
        return sum(r.meets(slo) for r in self.requests) / len(self.requests)

    def goodput(self, slo: SLO) -> float:
        """Requests per second that met both SLOs."""
        return sum(r.meets(slo) for r in self.requests) / self.duration_s if self.duration_s > 0 else 0.0

    def pool_utilisation(self, prefix: str) -> float:
        values = [u for w, u in self.utilisation.items() if w.startswith(prefix)]
        return sum(values) / len(values) if values else math.nan

    def summary(self, slo: SLO | None = None) -> dict:
        t, i = self.ttft, self.itl
        out = {"layout": self.layout, "trace": self.trace, "num_requests": len(self.requests),
               "num_completed": self.num_completed, "duration_s": round(self.duration_s, 3),
               "ttft_s": {"p50": t.p50, "p90": t.p90, "p99": t.p99},
               "itl_s": {"p50": i.p50, "p90": i.p90, "p99": i.p99},
               "utilisation": {w: round(u, 3) for w, u in self.utilisation.items()},
               "router_tokens_per_s": round(self.router_tokens_per_s, 1)}
        if slo is not None:
            out |= {"slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "target": slo.target},
                    "slo_attainment": self.attainment(slo), "goodput_rps": self.goodput(slo)}
        return out
