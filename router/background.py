"""Fire-and-forget tasks an owner starts and later cancels together (`Router`, `PoolManager`, `ReplicaSet`).

asyncio keeps only weak references to tasks, so a task nobody holds may be collected mid-flight; this set
holds them until they end, and `cancel`/`close` end the ones still running when their owner stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        """Cancel every task still running and wait until all have ended."""
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
