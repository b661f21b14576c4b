"""A benchmark's load-generating child process ends when the benchmark is killed (no orphan hammering the
machine's cores for every later measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PARENT = textwrap.dedent('''
    import os, sys, time
    from benchmarks.child import Child, process

    def child(path):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        if sys.argv[2] == "Child":
            Child(child, sys.argv[1])
        else:  # a child that answers over queues of its own (router_bench's router and clients)
            process(child, sys.argv[1]).start()
        time.sleep(600)
''')


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # (a zombie has ended; only its parent's reaping is left)


@pytest.mark.parametrize("how", ["Child", "process"])
def test_a_child_ends_when_its_benchmark_is_killed(tmp_path, how):
    script, pid_file = tmp_path / "parent.py", tmp_path / "child.pid"
    script.write_text(PARENT)
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file), how], cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not _gone(child)
        parent.kill()  # SIGKILL: no atexit, so multiprocessing's daemon flag alone would not end the child
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, f"child {child} outlived its killed parent"
            time.sleep(0.05)
    finally:
        parent.kill()
