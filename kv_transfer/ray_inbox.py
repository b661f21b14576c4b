"""The Ray transport's mailbox: one small async actor per receiving process, holding named boxes.

A receiver reads its box (`rx/<endpoint>/<incarnation>`); senders drop messages in it, each layer's bytes
as an ObjectRef (the bytes themselves stay in the object store until the receiver fetches them). Replies
for a link go to the box `reply/<link id>` in the same actor, which the sender long-polls. The actor is
owned by the receiving process, so it dies with it, and a sender's next call fails instead of hanging.

This module imports only ray and asyncio: the actor's process never needs torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict, deque
from typing import Any

import ray


@ray.remote(num_cpus=0)
class KVInbox:
    def __init__(self) -> None:
        self._boxes: defaultdict[str, deque[Any]] = defaultdict(deque)
        self._events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def ready(self) -> bool:
        return True

    async def put(self, box: str, items: list[Any]) -> None:
        self._boxes[box].extend(items)
        self._events[box].set()

    async def take(self, box: str, wait_s: float) -> list[Any]:
        """Everything in `box`, waiting up to `wait_s` for something to arrive."""
        if not self._boxes[box]:
            event = self._events[box]
            event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), wait_s)
        items = list(self._boxes[box])
        self._boxes[box].clear()
        return items

    async def drop(self, box: str) -> None:
        self._boxes.pop(box, None)
        self._events.pop(box, None)


_inbox: Any = None
_inbox_lock = threading.Lock()


def process_inbox(timeout_s: float) -> Any:
    """This process's KVInbox handle, made on first use (every receiver of the process shares it) and
    answering before it is handed out: starting an actor takes a while, a message to it must not."""
    global _inbox
    with _inbox_lock:
        if _inbox is None:
            inbox = KVInbox.options(max_concurrency=1000).remote()
            ray.get(inbox.ready.remote(), timeout=timeout_s)
            _inbox = inbox
        return _inbox
