"""A decode worker's step streams: one per router replica, each carrying the tokens of that replica's
attempts (`owner_of` their keys) and every step's load.

The engine loop thread publishes each step; router replicas subscribe from the actor's event loop. Steps
for a replica that has not subscribed yet (a request can reach a fresh worker before its router's stream
does) wait in a bounded backlog instead of being dropped: a dropped step is a missing token. A replica
declared gone (`forget(final=True)`) gets nothing more, not even a late subscription.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from protocol.messages import RouterId, StepOutput, TokenDelta, owner_of

# steps kept for a router replica that has not subscribed yet: beyond this the replica is not coming (it died
# before subscribing), and its sequences are freed by the worker's `release_router`
MAX_EARLY_STEPS = 4096


class StepFanout:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # each router replica's stream, by its id (None for a lone router): (its loop, its queue)
        self._outboxes: dict[RouterId, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepOutput]]] = {}
        self._early: dict[RouterId, list[StepOutput]] = {}
        self._released: set[RouterId] = set()  # router replicas gone: their late tokens go nowhere

    async def subscribe(self, router_id: RouterId) -> AsyncIterator[StepOutput]:
        """Replica `router_id`'s steps, forever; subscribing again replaces its previous stream."""
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._lock:
            if router_id in self._released:
                return  # a replica declared gone: a late subscription of its must not take steps again
            self._outboxes[router_id] = (asyncio.get_running_loop(), queue)
            early = self._early.pop(router_id, [])
        try:
            for out in early:
                yield out
            while True:
                yield await queue.get()
        finally:
            with self._lock:
                if self._outboxes.get(router_id, (None, None))[1] is queue:
                    del self._outboxes[router_id]

    def publish(self, out: StepOutput) -> None:
        """Send a step to the router replicas (from any thread): each gets its own attempts' tokens, and
        every one the load."""
        with self._lock:
            outboxes = dict(self._outboxes)
        if len(outboxes) == 1 and not self._early:  # the usual case, one router: the step as it is
            (owner, (loop, queue)), = outboxes.items()
            if all(owner_of(d.request_id) == owner for d in out.deltas):
                loop.call_soon_threadsafe(queue.put_nowait, out)
                return
        by_owner: dict[RouterId, list[TokenDelta]] = {owner: [] for owner in outboxes}
        for d in out.deltas:
            by_owner.setdefault(owner_of(d.request_id), []).append(d)
        with self._lock:
            for owner, deltas in by_owner.items():
                part = StepOutput(out.step, out.time, deltas, out.load, out.stats)
                if owner in self._outboxes:
                    loop, queue = self._outboxes[owner]
                    loop.call_soon_threadsafe(queue.put_nowait, part)
                elif deltas and owner not in self._released:  # not subscribed yet: kept for its stream
                    early = self._early.setdefault(owner, [])
                    if len(early) < MAX_EARLY_STEPS:
                        early.append(part)

    def forget(self, router_id: RouterId, final: bool) -> None:
        """`final`: the replica is gone: its steps go nowhere from now on; otherwise it lost its stream and
        subscribes again."""
        with self._lock:
            self._outboxes.pop(router_id, None)
            self._early.pop(router_id, None)
            if final:
                self._released.add(router_id)
