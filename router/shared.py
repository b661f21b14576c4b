"""What the router's parts share: the workers, the attempts in flight, the room signal, and the calls every
part makes to a worker the same way (a failed call, an abort in the background, a wait for room).

`Router` (the request driver) composes the parts that use it: `Admission` (placement and room),
`StepStreams` (decode workers' steps to attempts), `Drains` (drains and KV moves) and `CacheView` (load
reports and the prefix index). Each holds this object, not the router, so each reads alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from protocol import Cause, PoolKind
from router.background import Background
from router.config import RouterConfig
from router.cost_model import CostModel
from router.lifecycle import Attempt, AttemptFailed
from router.observer import RequestObserver
from router.prefix_index import PrefixIndex
from router.registry import Worker, WorkerRegistry
from router.worker_client import Failure, WorkerError

logger = logging.getLogger(__name__)

__all__ = ["RouterError", "Shared"]


class RouterError(Exception):
    """A request that cannot be served; `code` is the gRPC status name the servicer answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Shared:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, observer: RequestObserver) -> None:
        self.config = config
        self.block_size = config.block_size
        self.registry = registry
        self.observer = observer
        self.index = PrefixIndex()
        # (it learns the KV bytes per token from the first worker)
        self.cost = CostModel(bytes_per_token=0, priors=config.cost_priors)
        self.attempts: dict[str, Attempt] = {}  # by attempt key: where worker messages are routed
        self.room = asyncio.Event()  # set whenever blocks may have been freed or a worker joined
        self.background = Background()
        self.aborts: dict[str, set[asyncio.Task]] = {}  # by worker id: aborts sent, not yet answered

    @property
    def workers(self) -> dict[str, Worker]:
        return self.registry.workers

    @property
    def disaggregated(self) -> bool:
        return any(w.kind is PoolKind.PREFILL for w in self.workers.values())

    def call_failed(self, worker: Worker, e: WorkerError, cause: Cause) -> AttemptFailed:
        """A call to `worker` failed: if it found the worker dead, lose it now (before liveness would)."""
        if e.lost:
            self.registry.lose(worker, e.reason)
        elif e.failure is Failure.ERROR:  # the worker raised: it lives, the call failed
            cause = Cause.WORKER_ERROR
        return AttemptFailed(cause, worker.worker_id, e.reason)

    def abort_soon(self, worker: Worker, key: str) -> None:
        """Tell `worker` to free what it holds for `key`, in the background (a drain waits for these)."""
        task = self.background.spawn(self._abort(worker, key))
        pending = self.aborts.setdefault(worker.worker_id, set())
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def _abort(self, worker: Worker, key: str) -> None:
        if not worker.alive:
            return
        try:
            await worker.client.abort(key, self.config.call_timeout_s)
        except WorkerError as e:  # best effort: a dead worker holds nothing, a stuck one is declared dead
            self.call_failed(worker, e, Cause.WORKER_ERROR)
            logger.warning("abort of %s on %s failed: %s", key, worker.worker_id, e)
        self.room.set()

    async def wait_room(self, deadline: float, code: str, why: str) -> None:
        """Wait until something may have changed (blocks freed, a worker joined); past `deadline`, fail with
        `code` (a gRPC status name) and `why`."""
        remaining = deadline - time.time()
        if remaining <= 0:
            raise RouterError(code, why)
        self.room.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.room.wait(), timeout=min(remaining, 0.5))
