"""How much of the machine a run had: CPU used by this process tree (router, load generator, the Ray
cluster it started) against CPU used by everything else while the run lasted.

On a shared machine the second number is the noise: a neighbour's job that takes a core halves a
1-thread worker's speed, and it comes and goes between layouts. Reported with every run, in cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def _busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _tree_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # gone between listing and reading
            pass
    return total


@dataclass(frozen=True)
class CpuShare:
    """CPU seconds over a wall-clock span; shares of several spans add up."""

    ours_s: float  # used by this process tree
    others_s: float  # used by every other process on the machine
    wall_s: float

    @property
    def ours_cores(self) -> float:
        return self.ours_s / self.wall_s

    @property
    def others_cores(self) -> float:
        return self.others_s / self.wall_s

    def __add__(self, other: CpuShare) -> CpuShare:
        return CpuShare(self.ours_s + other.ours_s, self.others_s + other.others_s, self.wall_s + other.wall_s)

    def to_dict(self) -> dict:
        return {"ours_cores": round(self.ours_cores, 2), "others_cores": round(self.others_cores, 2),
                "cpus": os.cpu_count(), "wall_s": round(self.wall_s, 1)}


class CpuMeter:
    """Start it before a run, `stop()` after; None from `stop()` when psutil is missing."""

    def __init__(self) -> None:
        try:
            self._start = (time.perf_counter(), _busy_seconds(), _tree_seconds())
        except ImportError:
            self._start = None

    def stop(self) -> CpuShare | None:
        if self._start is None:
            return None
        t0, busy0, ours0 = self._start
        wall = max(time.perf_counter() - t0, 1e-9)
        busy, ours = _busy_seconds() - busy0, _tree_seconds() - ours0
        return CpuShare(ours, max(0.0, busy - ours), wall)
