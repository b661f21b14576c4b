"""What the serve process says to its operator: one line on stderr per event (`log`), and `ServeError`, the
refusal to start whose message says what to change.

NOTE: its own module, below everything else in `control/`, so that the Ray cluster start, the doors, the
server and the replicas speak with one voice without importing each other.
"""

from __future__ import annotations

import sys


class ServeError(RuntimeError):
    """The deployment cannot start (a port taken, ...); the message says what to change."""


def log(msg: str) -> None:
    print(f"pdserve: {msg}", file=sys.stderr, flush=True)
