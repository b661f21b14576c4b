"""The autoscaler's pure parts: live traffic from the router's counters, a forecast of the next interval,
and the decision rule (cool-down, scale-down hysteresis, pool bounds). `planner.watch` runs them.

    traffic      = deltas of pdserve_requests_total, pdserve_prompt_tokens_total,
                   pdserve_generation_tokens_total between two scrapes
    rate         = requests over the newest intervals that together saw at least `min_requests` (at most
                   `max_intervals` of them): an interval alone at high rates, longer windows at low ones
    forecast     = Holt's linear smoothing of the request rate (level + trend), never below 0
    decision     = up at once (past the pool's cool-down); down only after `down_after` intervals in a row
                   asked for less (and past the cool-down); always within [min_pool_size, max_pool_size]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

REQUESTS = "pdserve_requests_total"
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
OUTPUT_TOKENS = "pdserve_generation_tokens_total"


def parse_counters(text: str) -> dict[str, float]:
    """The router's counters we read, each summed over its labels, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {REQUESTS: 0.0, PROMPT_TOKENS: 0.0, OUTPUT_TOKENS: 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in totals:
                totals[s.name] += s.value
    return totals


@dataclass(frozen=True)
class Traffic:
    """What came in over one interval."""

    rate: float  # requests per second
    mean_prompt: float  # tokens
    mean_output: float

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float], seconds: float) -> Traffic:
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        n = after[REQUESTS] - before[REQUESTS]
        if n <= 0:
            return cls(0.0, 0.0, 0.0)
        return cls(n / seconds, (after[PROMPT_TOKENS] - before[PROMPT_TOKENS]) / n,
                   (after[OUTPUT_TOKENS] - before[OUTPUT_TOKENS]) / n)


@dataclass
class RateWindow:
    """The request rate over enough requests to mean something. A count of Poisson arrivals is off by about
    1/sqrt(n): one 15 s interval at 0.1 req/s sees 0-3 requests, which read as rates from 0 to 0.2 and had a
    pool flap up and down in a low phase (docs/planner.md, autoscale run 1). The window reaches back over
    the newest intervals until they hold `min_requests` (8: about 35%), and never more than
    `max_intervals`. A step up shows at once (the newest interval alone holds enough); after a fall the
    window reaches back into the busier intervals until the quiet ones hold 8 requests, so it reads high for
    a few intervals: it errs towards holding workers, as scale-downs do (`ScalePolicy.down_after`)."""

    min_requests: int = 8
    max_intervals: int = 6
    scrapes: deque[tuple[float, Mapping[str, float]]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.min_requests < 1 or self.max_intervals < 1:
            raise ValueError(f"bad rate window: {self}")

    def add(self, t: float, counters: Mapping[str, float]) -> float:
        """Record a scrape taken at `t` (seconds); returns the windowed rate (0 until two scrapes)."""
        if any(c[REQUESTS] > counters[REQUESTS] for _, c in self.scrapes):  # a restarted router counts from 0
            self.scrapes.clear()
        self.scrapes.append((t, counters))
        while len(self.scrapes) > self.max_intervals + 1:
            self.scrapes.popleft()
        *earlier, (t_new, newest) = self.scrapes
        if not earlier:
            return 0.0
        # the newest earlier scrape with enough requests since, else the oldest one kept
        enough = (s for s in reversed(earlier) if newest[REQUESTS] - s[1][REQUESTS] >= self.min_requests)
        t_old, old = next(enough, earlier[0])
        return (newest[REQUESTS] - old[REQUESTS]) / (t_new - t_old) if t_new > t_old else 0.0


@dataclass
class Forecaster:
    """Holt's linear smoothing of the request rate: the next interval's rate = level + trend."""

    alpha: float = 0.5  # weight of the newest rate in the level
    beta: float = 0.3  # weight of the newest change in the trend
    level: float | None = None
    trend: float = 0.0

    def observe(self, rate: float) -> float:
        """Fold in an interval's rate; returns the forecast of the next one."""
        if self.level is None:
            self.level = rate
        else:
            previous = self.level
            self.level = self.alpha * rate + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend
        return max(0.0, self.level + self.trend)


@dataclass(frozen=True)
class ScalePolicy:
    """How eagerly the autoscaler acts."""

    cooldown_s: float = 60.0  # after a pool changes, it does not change again for this long
    down_after: int = 2  # intervals in a row that must ask for fewer workers before a scale-down
    min_pool_size: int = 1
    max_pool_size: int = 64  # as `pdserve serve --max-pool-size`

    def __post_init__(self) -> None:
        if self.cooldown_s < 0 or self.down_after < 1 or not 1 <= self.min_pool_size <= self.max_pool_size:
            raise ValueError(f"bad scale policy: {self}")


@dataclass(frozen=True)
class Decision:
    """One pool's change, and why."""

    pool: str
    current: int
    target: int
    reason: str


def sizes_to_ask(wanted: Mapping[str, int], current: Mapping[str, int], meets: bool) -> dict[str, int]:
    """Each pool's size to ask for: the plan's, except that where no layout meets the SLO (a load past what
    the pool caps can serve) no pool shrinks. The layout that comes closest may have fewer workers than the
    pools have (`SizingPlan.closest` prefers the fewest within a few points); draining one under that load
    only makes it worse, as a live run did (docs/planner.md, autoscale run 4)."""
    if meets:
        return dict(wanted)
    return {pool: max(n, current.get(pool, 0)) for pool, n in wanted.items()}


@dataclass
class Autoscaler:
    policy: ScalePolicy = field(default_factory=ScalePolicy)
    last_change: dict[str, float] = field(default_factory=dict)  # by pool: when it last changed
    down_votes: dict[str, int] = field(default_factory=dict)  # by pool: intervals in a row that asked for less

    def decide(self, now: float, current: Mapping[str, int], wanted: Mapping[str, int], why: str) -> list[Decision]:
        """The changes to make now: `wanted` is the plan's size of each pool, `current` the pools' targets."""
        out = []
        for pool, want in wanted.items():
            have = current.get(pool, 0)
            want = min(self.policy.max_pool_size, max(self.policy.min_pool_size, want))
            cooling = now - self.last_change.get(pool, float("-inf")) < self.policy.cooldown_s
            if want < have:
                self.down_votes[pool] = self.down_votes.get(pool, 0) + 1
            else:
                self.down_votes[pool] = 0
            if want == have or cooling:
                continue
            if want < have and self.down_votes[pool] < self.policy.down_after:
                continue
            self.last_change[pool] = now
            self.down_votes[pool] = 0
            verb = "up" if want > have else "down (drain, KV moved)"
            out.append(Decision(pool, have, want, f"{pool} {have} -> {want} {verb}: {why}"))
        return out
