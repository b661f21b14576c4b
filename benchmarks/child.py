"""Load-generating processes of a benchmark (attackers, flooding tenants) end with the benchmark.

`multiprocessing`'s daemon flag ends a child when its parent exits normally; a benchmark stopped by a
signal leaves it running, and a closed-loop client then hammers whatever took its port, at full speed, on a
machine whose cores every later measurement shares. `die_with_parent` asks Linux for a SIGKILL when the
parent goes (PR_SET_PDEATHSIG); elsewhere it does nothing and only the daemon flag holds. `Child` starts
such a process and hands back what its function returned; `process` makes one that answers over queues of
its own.

NOTE: Linux sends it when the *thread* that started the child ends: start children from a thread that
outlives them (or join them before that thread returns, as the benchmarks here do)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
CONTEXT = multiprocessing.get_context("spawn")  # (its `Event()`s are what a child's arguments may hold)


class Child:
    """`target(*args)` in a spawned process that dies with this one; `answer` is what it returned."""

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        self._answer, end = CONTEXT.Pipe(duplex=False)
        self.process = CONTEXT.Process(target=_main, args=(os.getpid(), target, args, end), daemon=True)
        self.process.start()

    def answer(self, timeout: float, default: Any) -> Any:
        """Its return value (`default` if none came within `timeout` seconds), once it has ended."""
        got = self._answer.recv() if self._answer.poll(timeout) else default
        self.process.join(30)
        return got


def process(target: Callable[..., Any], *args: Any) -> Any:
    """An unstarted spawned process (a daemon) that runs `target(*args)` and dies with this one."""
    return CONTEXT.Process(target=_run, args=(os.getpid(), target, args), daemon=True)


def _run(parent: int, target: Callable[..., Any], args: tuple) -> None:
    die_with_parent(parent)
    target(*args)


def _main(parent: int, target: Callable[..., Any], args: tuple, out: Any) -> None:
    die_with_parent(parent)
    out.send(target(*args))


def die_with_parent(parent_pid: int) -> None:
    """Call first in the child: a SIGKILL when the parent exits, and at once if it already has."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # (it died before the request above was in place)
        os._exit(1)
