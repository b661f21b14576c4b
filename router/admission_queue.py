"""The admission queue: attempts that found no decode worker with room for their KV blocks wait here for
room, bounded and by priority class.

Strict priority: while a higher class waits, a lower one does not try the room. A full queue sheds its newest
waiter of the lowest class below the newcomer's (RESOURCE_EXHAUSTED for it), or refuses the newcomer at once;
a waiter past its deadline gets RESOURCE_EXHAUSTED too. Nothing here reserves: `router.admission.Admission`
tries the room again each time this returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.shared import RouterError, Shared


@dataclass(eq=False)
class _Waiter:
    """An attempt in the admission queue."""

    priority: int  # its request's class: higher classes try the room first, the lowest is shed first
    shed: bool = False  # set when a higher class took its place in a full queue


class AdmissionQueue:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.config = shared.config
        self.num_queued = 0  # attempts waiting in the admission queue
        self._waiting: list[_Waiter] = []  # those attempts, in arrival order

    async def wait_for_room(self, need: int, deadline: float, priority: int) -> None:
        """Wait in the bounded admission queue until blocks may have been freed and no higher priority class
        waits; RESOURCE_EXHAUSTED past `deadline`. A full queue sheds its newest waiter of the lowest class
        below `priority` to make room (RESOURCE_EXHAUSTED for it), or refuses this one at once."""
        if self.num_queued >= self.config.max_queue:
            lower = [w for w in self._waiting if w.priority < priority and not w.shed]
            if not lower:
                raise RouterError("RESOURCE_EXHAUSTED", f"no decode worker has room for {need} KV blocks and "
                                  f"the admission queue is full ({self.config.max_queue} waiting); retry later")
            lowest = min(w.priority for w in lower)
            victim = [w for w in lower if w.priority == lowest][-1]
            victim.shed = True
            self.shared.room.set()  # (wakes it: it leaves at once)
        me = _Waiter(priority)
        self._waiting.append(me)
        self.num_queued += 1
        try:
            while True:
                await self.shared.wait_room(deadline, "RESOURCE_EXHAUSTED", f"no decode worker had room for {need} "
                                            f"KV blocks within {self.config.admission_timeout_s:.0f}s; retry later")
                if me.shed:
                    raise RouterError("RESOURCE_EXHAUSTED", f"shed from the full admission queue for a request of a "
                                      f"higher priority class than this one's ({priority}); retry later")
                # NOTE: strict priority: a higher class that waits tries the room first
                if not any(w.priority > priority and not w.shed for w in self._waiting):
                    return
        finally:
            self._waiting.remove(me)
            self.num_queued -= 1
