"""How requests are offered: open loop (Poisson arrivals at a rate) or closed loop (a fixed concurrency).

Open loop is what a public endpoint sees: clients arrive whether or not the server keeps up, so queues and
latency grow without bound past capacity, which is what a goodput search needs. Closed loop is a fixed set
of users each waiting for its answer before sending again: the server's batch stays near `concurrency`,
which keeps a decode batch steady (the interference run relies on that).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """One run's offered load, bounded in count and in time."""

    rate: float | None = None  # open loop: mean requests per second (Poisson arrivals)
    concurrency: int | None = None  # closed loop: requests kept in flight
    num_requests: int = 100  # send at most this many
    duration_s: float | None = None  # send nothing after this many seconds (in-flight requests finish)
    seed: int = 0  # arrival times (open loop)

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of rate (open loop) and concurrency (closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    @property
    def label(self) -> str:
        return f"{self.rate:g} req/s" if self.open_loop else f"concurrency {self.concurrency}"

    def arrival_offsets(self) -> list[float]:
        """Open loop: each request's send time in seconds from the start, at most `num_requests` of them,
        none past `duration_s`."""
        assert self.rate is not None, "arrival_offsets() is for open loop"
        offsets = poisson_offsets(self.num_requests, self.rate, self.seed)
        if self.duration_s is not None:
            offsets = [t for t in offsets if t <= self.duration_s]
        return offsets


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times of a Poisson process of `rate` per second: the first at 0, then exponential gaps
    of mean 1/rate. The gaps for one seed are the same at every rate, only scaled by 1/rate, so a rate
    search replays one arrival pattern faster or slower."""
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    rng = random.Random(f"arrivals/{seed}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(1.0) / rate
        out.append(t)
    return out
