"""What every worker role shares: one engine, its step loop, where it runs, and the calls every role answers.

A worker is a Ray actor holding one model replica (an `EngineBackend`) driven by an `EngineLoop` thread. Its
role (prefill, decode, colocated; `prefill_worker`, `decode_worker`) adds the requests' own calls and what
runs on the loop thread between steps (`_poll`), after each (`_on_step`) and when a step fails
(`_fail_transfers`). The engine and the KV transports are passed in (the roles make the default ones from
their configs), so the same classes run in process, without Ray, in the tests.

The calls here are the router's view of any worker: `info`, `ping`, `report`, `abort`, `release_router`,
`describe`, `shutdown`. Everything that touches the engine runs on the loop thread (`_on_loop`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from engine.backend import EngineBackend, LayerHookFactory
from engine.engine_loop import EngineLoop
from engine.request import Request
from protocol.kinds import PoolKind
from protocol.messages import EngineLoad, Heartbeat, LoadReport, RouterId, StepOutput, WorkerInfo, owner_of
from protocol.node import node_identity

T = TypeVar("T")


class Closable(Protocol):
    def close(self) -> None: ...


class WorkerBase:
    kind: PoolKind
    loop: EngineLoop  # started by the role's constructor, last (`_start_loop`)

    def __init__(self, worker_id: str, engine: EngineBackend) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.node_id, self.node_ip = node_identity()

    def _start_loop(self, layer_hook_for: LayerHookFactory | None = None) -> None:
        """Start the engine's step loop; a role calls it last in its constructor."""
        self.loop = EngineLoop(self.engine, self._on_step, poll=self._poll, layer_hook_for=layer_hook_for,
                               on_fail=self._fail_transfers, name=f"{self.worker_id}-loop")
        self.loop.start()

    async def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop thread between steps and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))

    # -- every role -------------------------------------------------------------------------------------

    async def info(self) -> WorkerInfo:
        spec = self.engine.cache_spec
        return WorkerInfo(self.worker_id, self.kind, self.node_id, self.node_ip, spec.block_size,
                          self.engine.num_blocks, pid=os.getpid(),
                          kv_bytes_per_token=spec.bytes_per_block // spec.block_size, **self._info_fields())

    async def ping(self) -> Heartbeat:
        return Heartbeat(self.worker_id, time.monotonic() - self.loop.last_progress, self.loop.busy,
                         self.loop.alive)

    async def report(self, since: int = -1) -> LoadReport:
        """Load, and the prefix-cache changes after change number `since` (see `CacheEventLog`)."""
        return await self._on_loop(lambda: self.engine.load_report(self.worker_id, since))

    async def abort(self, request_id: str) -> None:
        """Free whatever the request holds here; a no-op for unknown or finished requests."""
        await self._on_loop(lambda: self._abort(request_id))

    async def release_router(self, router_id: RouterId, final: bool = True) -> int:
        """End everything router replica `router_id`'s attempts hold here. `final`: the replica is gone;
        otherwise it lost touch with this worker and starts over. Returns how many attempts were ended."""

        def release() -> int:
            self._forget_router(router_id, final)
            keys = [k for k in self._attempt_keys() if owner_of(k) == router_id]
            for key in keys:
                self._abort(key, f"router replica {router_id} is gone")
            return len(keys)

        return await self._on_loop(release)

    async def describe(self) -> dict[str, Any]:
        """What this worker holds right now (for debugging and operators)."""
        return await self._on_loop(self._describe)

    async def shutdown(self) -> EngineLoad:
        """Stop; returns the load it stopped with (a drained worker's shows it held nothing)."""
        load = await self._on_loop(self.engine.load)
        self.loop.shutdown()
        for transport in self._transports():
            transport.close()
        return load

    # -- what a role fills in ---------------------------------------------------------------------------

    def _info_fields(self) -> dict[str, Any]:
        """The role's own `WorkerInfo` fields."""
        return {}

    def _transports(self) -> Iterable[Closable]:
        """The KV transports `shutdown` closes."""
        return ()

    def _attempt_keys(self) -> Iterable[str]:
        """Every attempt key this worker holds something for."""
        return list(self.engine.requests)

    def _forget_router(self, router_id: RouterId, final: bool) -> None:
        """`release_router`'s own bookkeeping before the router's attempts are ended (on the loop thread)."""

    def _abort(self, request_id: str, reason: str = "aborted by the router") -> None:
        """End the attempt and free what it holds (on the loop thread); a no-op for an unknown one."""
        self.engine.abort_request(request_id)

    def _describe(self) -> dict[str, Any]:
        return {"requests": {rid: r.status.name for rid, r in self.engine.requests.items()}}

    def _on_step(self, out: StepOutput) -> None:
        """A step's tokens (on the loop thread)."""

    def _poll(self) -> bool:
        """Before every step (on the loop thread); True while waiting on a transfer."""
        return False

    def _fail_transfers(self, requests: list[Request]) -> None:
        """A failed step ends these requests: fail their transfers before their blocks are freed."""
