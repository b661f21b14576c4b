"""The deployment's processes as the lead sees them: which node this is, which process this is, and how a
process on this node is ended (a replica that is lost, a lead that another replica took over from)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

from control.messages import ProcessInfo

logger = logging.getLogger(__name__)


def this_node() -> Any:
    """A Ray scheduling strategy that places an actor on the calling process's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def this_process() -> ProcessInfo:
    """The calling process; its title is how its command line starts: the whole of it, or a Ray actor's
    `ray::Class` (Ray rewrites the rest)."""
    import ray

    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    title = cmdline.split(b"\0")[0].split(b".")[0] if cmdline.startswith(b"ray::") else cmdline
    return ProcessInfo(os.getpid(), ray.get_runtime_context().get_node_id(), title)


def _local_pid(process: ProcessInfo | None) -> int | None:
    """`process`'s pid when it runs on this node; None otherwise."""
    import ray

    if process is None or not process.pid:
        return None
    return process.pid if process.node_id == ray.get_runtime_context().get_node_id() else None


def _is_process(pid: int, title: bytes) -> bool:
    """Whether `pid` is alive and its command line still starts with `title` (else it is gone, and the pid
    may be another process's now)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(title)
    except OSError:
        return False


def kill_process(process: ProcessInfo | None) -> None:
    """SIGKILL `process` if it runs on this node and is still the process its title names; elsewhere,
    nothing."""
    pid = _local_pid(process)
    if pid is None or not _is_process(pid, process.title):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone meanwhile
    except OSError as e:
        logger.warning("could not end process %d: %s", pid, e)


async def fence(process: ProcessInfo | None, grace_s: float) -> None:
    """End a lead another replica took over from, when it runs on this node: wake it (SIGCONT: a stopped
    one), give it `grace_s` to learn at its next beat that it was deposed and exit, then SIGKILL it.
    NOTE: a SIGKILL straight into a SIGSTOPped serve process (a Ray driver) killed the new lead itself half
    a second later, or left it unable to start the replacement replica (Ray 2.60, reproduced every time);
    a driver that exits by itself, or is killed while running, does not."""
    pid = _local_pid(process)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _is_process(pid, process.title):
        await asyncio.sleep(0.1)
    kill_process(process)
