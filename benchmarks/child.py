"""Load-generating processes of a benchmark (attackers, flooding tenants) end with the benchmark.

`multiprocessing`'s daemon flag ends a child when its parent exits normally; a benchmark stopped by a
signal leaves it running, and a closed-loop client then hammers whatever took its port, at full speed, on a
machine whose cores every later measurement shares. `die_with_parent` asks Linux for a SIGKILL when the
parent goes (PR_SET_PDEATHSIG); elsewhere it does nothing and only the daemon flag holds.

NOTE: Linux sends it when the *thread* that started the child ends: start children from a thread that
outlives them (or join them before that thread returns, as the benchmarks here do)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Call first in the child: a SIGKILL when the parent exits, and at once if it already has."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # (it died before the request above was in place)
        os._exit(1)
