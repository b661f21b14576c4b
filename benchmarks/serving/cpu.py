"""How much of the machine a run had: CPU used by this process tree (router, load generator, the Ray
cluster it started) against CPU used by everything else while the run lasted, and, probed just before and
after it, the memory bandwidth and the matrix-multiply speed of one core.

On a shared machine these are the noise: a neighbour's job that takes a core halves a 1-thread worker's
speed, and it comes and goes between layouts; and with nothing else on it busy, this VM's prefill and
decode speeds each drift by a fifth within an hour (a slower neighbour on the host is invisible from
inside, and it reports no steal time). A decode step is bound by memory bandwidth and a prefill by
matrix multiplies: the probes are an index of each. Reported with every run.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROBE_BYTES = 64 << 20  # past any cache here
PROBE_S = 1.0  # (one second: within 2% run to run here; a quarter second, 10%)


def _median_rate(work, amount: float, seconds: float) -> float:
    """`amount` over the seconds one `work()` takes: the median of repeats for about `seconds`, 3 at least."""
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 3:
        t0 = time.perf_counter()
        work()
        rates.append(amount / (time.perf_counter() - t0))
    return statistics.median(rates)


def memory_gbps(seconds: float | None = None) -> float:
    """One core's copy bandwidth now (GB/s of bytes read), the median of repeated copies of `PROBE_BYTES`
    for about `seconds` (`PROBE_S`): an index of the machine's memory speed to compare runs by, not a
    roofline."""
    import numpy as np

    src = np.ones(PROBE_BYTES // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # (pages touched)
    seconds = PROBE_S if seconds is None else seconds
    return _median_rate(lambda: np.copyto(dst, src), PROBE_BYTES / 1e9, seconds)


def compute_gflops(seconds: float | None = None) -> float:
    """One core's float32 matrix-multiply speed now (GFLOP/s), the median of repeated products shaped like
    a prefill chunk's (256 tokens through a 2,048-wide layer) for about `seconds` (`PROBE_S`): an index, as
    `memory_gbps` is. Measured in a child process with one BLAS thread: the caller's own thread pools stay
    as they are, and the router's and planner's processes never load torch."""
    out = subprocess.run([sys.executable, "-c", f"from benchmarks.serving.cpu import _gemm_gflops; "
                          f"print(_gemm_gflops({PROBE_S if seconds is None else seconds}))"],
                         env=os.environ | dict.fromkeys(_BLAS_THREADS, "1"), capture_output=True, text=True,
                         timeout=60, check=True)
    return float(out.stdout)


_BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _gemm_gflops(seconds: float) -> float:
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.random((256, 2048), np.float32), rng.random((2048, 2048), np.float32)
    return _median_rate(lambda: a @ b, 2 * a.shape[0] * a.shape[1] * b.shape[1] / 1e9, seconds)


def machine_speed() -> tuple[float, float] | None:
    """(memory_gbps(), compute_gflops()): 2 s. None, with a warning, where a probe fails: it is context
    for a run, never a reason to lose one."""
    try:
        return memory_gbps(), compute_gflops()
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        logger.warning("the machine speed probe failed (%s); this run goes without it", e)
        return None


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
    speeds: tuple[tuple[float, float], ...] = ()  # `machine_speed()` before and after each span

    @property
    def ours_cores(self) -> float:
        return self.ours_s / self.wall_s

    @property
    def others_cores(self) -> float:
        return self.others_s / self.wall_s

    def __add__(self, other: CpuShare) -> CpuShare:
        return CpuShare(self.ours_s + other.ours_s, self.others_s + other.others_s,
                        self.wall_s + other.wall_s, self.speeds + other.speeds)

    def to_dict(self) -> dict:
        out = {"ours_cores": round(self.ours_cores, 2), "others_cores": round(self.others_cores, 2),
               "cpus": os.cpu_count(), "wall_s": round(self.wall_s, 1)}
        if self.speeds:
            out["memory_gbps"] = round(statistics.mean(m for m, _ in self.speeds), 2)
            out["compute_gflops"] = round(statistics.mean(c for _, c in self.speeds), 1)
        return out


class CpuMeter:
    """Start it before a run, `stop()` after; None from `stop()` when psutil is missing. `probe`: measure
    `machine_speed()` at both ends (outside the span)."""

    def __init__(self, probe: bool = False) -> None:
        self._probe = probe
        self._speeds = (machine_speed(),) if probe else ()  # (None where it failed: left out at `stop`)
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
        speeds = self._speeds + ((machine_speed(),) if self._probe else ())
        return CpuShare(ours, max(0.0, busy - ours), wall, tuple(s for s in speeds if s is not None))
