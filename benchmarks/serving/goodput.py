"""Goodput: the highest request rate at which at least `target` of the requests meet both SLOs.

Found by a short search over open-loop rates: from `start_rate`, multiply by `factor` while the runs pass
(divide while they fail) until the rate is bracketed, then bisect the bracket until it is within
`tolerance` of its lower end or the probe budget is spent. The answer is the highest passing rate probed:
a lower bound, with the lowest failing rate above it as the bracket's top. Each probe is a full run with
fresh prompts, so it costs what a run at that rate costs, except that a probe stops as soon as it has
certainly failed (`hopeless`: more requests already missed than the target allows); on noisy machines a probe near the edge can pass
or fail by chance, which the bracket's width makes visible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from benchmarks.serving.client import RequestRecord, StopRule
from benchmarks.serving.stats import SLO


class Probe(NamedTuple):
    rate: float  # requests per second offered
    attainment: float  # share of the requests sent that met both SLOs


@dataclass(frozen=True)
class Goodput:
    rate: float  # the highest passing rate probed; 0.0 when none passed
    upper: float | None  # the lowest failing rate above it; None when nothing above it failed
    probes: tuple[Probe, ...]


@dataclass(frozen=True)
class GoodputSearch:
    start_rate: float
    max_probes: int = 5
    target: float = 0.9
    factor: float = 2.0  # step while the rate is not yet bracketed
    tolerance: float = 0.1  # stop once upper <= rate * (1 + tolerance)

    def __post_init__(self) -> None:
        if not self.start_rate > 0:
            raise ValueError(f"start_rate must be > 0, got {self.start_rate}")
        if self.max_probes < 1:
            raise ValueError(f"max_probes must be >= 1, got {self.max_probes}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if not self.factor > 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")

    def passed(self, p: Probe) -> bool:
        return p.attainment >= self.target

    def next_rate(self, probes: Sequence[Probe]) -> float | None:
        """The rate to probe next, or None when the search is done."""
        if not probes:
            return self.start_rate
        if len(probes) >= self.max_probes:
            return None
        result = self.result(probes)
        if result.rate == 0.0:  # nothing passed yet: go down
            rate = min(p.rate for p in probes) / self.factor
        elif result.upper is None:  # nothing above the best pass failed yet: go up
            rate = result.rate * self.factor
        elif result.upper <= result.rate * (1 + self.tolerance):
            return None
        else:
            rate = (result.rate + result.upper) / 2
        return round(rate, 6)  # 0.45, not 0.44999999999999996, in the report

    def hopeless(self, slo: SLO) -> StopRule:
        """A `run_load` stop rule: the probe has failed once more of its planned requests missed than the
        target allows, so running it to the end would only cost time (attainment can only be lower)."""

        def rule(records: Sequence[RequestRecord], planned: int, now: float) -> bool:
            allowed = planned - math.ceil(self.target * planned - 1e-9)  # misses a passing probe can have
            return sum(slo.missed(r, now) for r in records) > allowed

        return rule

    def result(self, probes: Sequence[Probe]) -> Goodput:
        passing = [p.rate for p in probes if self.passed(p)]
        best = max(passing, default=0.0)
        above = [p.rate for p in probes if not self.passed(p) and p.rate > best]
        return Goodput(best, min(above, default=None), tuple(probes))
