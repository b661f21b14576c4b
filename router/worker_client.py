"""How the router talks to one worker: a small async interface, and its implementation over a Ray actor.

The router never touches an actor handle itself. Everything it needs from a worker is a method here, and
every way a call can fail is one exception, `WorkerError`, that says whether the worker is gone (`lost`)
or only slow or unreachable for now. So the request lifecycle is testable with in-process fakes, no Ray.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from engine.sampling_params import SamplingParams
from protocol.messages import (
    DestinationWanted,
    EngineLoad,
    FirstToken,
    Heartbeat,
    KVMoveResult,
    LoadReport,
    PrefillResult,
    Reservation,
    RouterId,
    StepOutput,
    WorkerInfo,
)


class Failure(enum.Enum):
    LOST = "lost"  # the worker is dead: its actor died or was killed
    TIMEOUT = "timeout"  # no answer in time: stopped, stuck or cut off (liveness decides what it means)
    UNAVAILABLE = "unavailable"  # transiently unreachable (Ray's ActorUnavailableError): not death
    ERROR = "error"  # the call itself failed (an exception in the worker, an object lost): not death


class WorkerError(Exception):
    """A call to a worker failed, and how (`failure`)."""

    def __init__(self, worker_id: str, reason: str, failure: Failure) -> None:
        super().__init__(f"worker {worker_id} {'is gone' if failure is Failure.LOST else 'did not answer'}: "
                         f"{reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.failure = failure

    @property
    def lost(self) -> bool:
        return self.failure is Failure.LOST


class WorkerClient(ABC):
    """One worker, as the router sees it. Request ids passed here are the router's attempt keys."""

    worker_id: str

    @abstractmethod
    async def info(self) -> WorkerInfo: ...

    @abstractmethod
    async def ping(self, timeout: float) -> Heartbeat:
        """Answered by the worker's actor thread: proves the process lives and says whether its engine
        loop moves."""

    @abstractmethod
    async def report(self, since: int, timeout: float) -> LoadReport:
        """Load, and the prefix-cache changes after change number `since` (-1: the whole cache)."""

    @abstractmethod
    async def reserve(self, key: str, prompt: list[int], params: SamplingParams, src: str,
                      timeout: float) -> Reservation | None: ...

    @abstractmethod
    async def renew(self, keys: list[str], timeout: float) -> list[str]:
        """Renew these reservations' leases; returns the keys no longer reserved."""

    @abstractmethod
    def prefill(self, key: str, prompt: list[int], params: SamplingParams, reservation: Reservation | None,
                cache_since: int | None = None, verify_kv: bool = False
                ) -> AsyncIterator[DestinationWanted | FirstToken | PrefillResult]:
        """The first token as soon as it is sampled, then the outcome once the KV landed (a failure: only
        the outcome), whose load report holds the prefix-cache changes after `cache_since` (and with
        `verify_kv`, the SHA-256 of the KV sent). No timeout: a
        long prompt takes what it takes; liveness watches the worker meanwhile. With no `reservation`, first
        a `DestinationWanted` when the prompt nears its last chunk, which waits for `set_destination`."""

    @abstractmethod
    async def set_destination(self, key: str, reservation: Reservation, timeout: float) -> bool:
        """A prompt sent without its reservation gets it; False when the prompt is no longer there."""

    @abstractmethod
    async def start(self, key: str, first_token: int, timeout: float) -> bool: ...

    @abstractmethod
    async def submit(self, key: str, prompt: list[int], params: SamplingParams, timeout: float) -> None: ...

    @abstractmethod
    async def abort(self, key: str, timeout: float) -> None: ...

    @abstractmethod
    async def pause(self, key: str, timeout: float) -> None:
        """Backpressure: stop decoding this attempt (its blocks stay) until `resume`."""

    @abstractmethod
    async def resume(self, key: str, timeout: float) -> None: ...

    @abstractmethod
    async def hold(self, key: str, timeout: float) -> int | None:
        """Drain: take the decoding attempt out of the batch for good; the tokens it produced there, or
        None when it is not decoding (see `DecodeWorker.hold`)."""

    @abstractmethod
    async def connect(self, peers: list, timeout: float) -> None:
        """Drain: open KV links to these decode workers' receivers (their `WorkerInfo.kv_address`) ahead of
        the moves, so the first one does not wait for a link."""

    @abstractmethod
    async def send_kv(self, key: str, dst_key: str, reservation: Reservation, timeout: float) -> KVMoveResult:
        """Drain: push held `key`'s KV into a reservation made on another decode worker for `dst_key`; the
        worker's transfer and the call share the one bound, `timeout`."""

    @abstractmethod
    async def forget_kv(self, key: str, start: int, timeout: float) -> bool:
        """The attempt's KV from position `start` on failed its check: out of the worker's prefix cache."""

    @abstractmethod
    async def kv_digest(self, key: str, num_tokens: int, start: int, timeout: float) -> str:
        """SHA-256 of the attempt's K and V for its positions `start` to `num_tokens` (a transfer's or a
        move's bit-exact check)."""

    @abstractmethod
    def steps(self) -> AsyncIterator[StepOutput]:
        """The worker's per-step messages for this client's router replica, until it dies (then WorkerError
        with Failure.LOST)."""

    @abstractmethod
    async def release_router(self, router_id: RouterId, timeout: float, final: bool = True) -> int:
        """Free what router replica `router_id`'s attempts hold on the worker: it is gone (`final`), or it
        lost its step stream and subscribes again."""

    @abstractmethod
    async def shutdown(self, timeout: float) -> EngineLoad | None:
        """Stop the worker politely (close its KV links); the load it stopped with."""

    @abstractmethod
    def kill(self) -> None:
        """End the worker now (declared dead: stuck or unreachable). Idempotent."""


class RayWorkerClient(WorkerClient):
    """A worker that is a Ray actor (`PrefillWorker` or `DecodeWorker`)."""

    def __init__(self, worker_id: str, actor: Any, router_id: RouterId = None) -> None:
        self.worker_id = worker_id
        self.actor = actor
        self.router_id = router_id  # the router replica this client's step stream is for

    async def _call(self, ref, timeout: float | None):
        import ray

        try:
            return await (asyncio.wait_for(ref, timeout) if timeout is not None else ref)
        except asyncio.TimeoutError as e:
            raise WorkerError(self.worker_id, f"no answer within {timeout:.3g}s", Failure.TIMEOUT) from e
        except ray.exceptions.ActorUnavailableError as e:  # restarting or a broken connection: transient
            raise WorkerError(self.worker_id, f"unavailable: {e}", Failure.UNAVAILABLE) from e
        except ray.exceptions.RayActorError as e:
            raise WorkerError(self.worker_id, f"actor died: {e}", Failure.LOST) from e
        except ray.exceptions.RayError as e:  # RayTaskError (the worker raised), ObjectLostError, ...
            raise WorkerError(self.worker_id, f"call failed: {e}", Failure.ERROR) from e

    async def info(self) -> WorkerInfo:
        return await self._call(self.actor.info.remote(), None)

    async def ping(self, timeout: float) -> Heartbeat:
        return await self._call(self.actor.ping.remote(), timeout)

    async def report(self, since: int, timeout: float) -> LoadReport:
        return await self._call(self.actor.report.remote(since), timeout)

    async def reserve(self, key, prompt, params, src, timeout):
        return await self._call(self.actor.reserve.remote(key, prompt, params, src), timeout)

    async def renew(self, keys: list[str], timeout: float) -> list[str]:
        return await self._call(self.actor.renew.remote(keys), timeout)

    async def prefill(self, key, prompt, params, reservation, cache_since=None, verify_kv=False):
        async for item in self._stream(self.actor.prefill.options(num_returns="streaming").remote(
                key, prompt, params, reservation, cache_since, verify_kv), "prefill"):
            yield item

    async def set_destination(self, key: str, reservation: Reservation, timeout: float) -> bool:
        return await self._call(self.actor.set_destination.remote(key, reservation), timeout)

    async def start(self, key: str, first_token: int, timeout: float) -> bool:
        return await self._call(self.actor.start.remote(key, first_token), timeout)

    async def submit(self, key, prompt, params, timeout):
        await self._call(self.actor.submit.remote(key, prompt, params), timeout)

    async def abort(self, key: str, timeout: float) -> None:
        await self._call(self.actor.abort.remote(key), timeout)

    async def pause(self, key: str, timeout: float) -> None:
        await self._call(self.actor.pause.remote([key]), timeout)

    async def resume(self, key: str, timeout: float) -> None:
        await self._call(self.actor.resume.remote([key]), timeout)

    async def hold(self, key: str, timeout: float) -> int | None:
        return await self._call(self.actor.hold.remote(key), timeout)

    async def connect(self, peers: list, timeout: float) -> None:
        await self._call(self.actor.connect.remote(peers), timeout)

    async def send_kv(self, key: str, dst_key: str, reservation: Reservation, timeout: float) -> KVMoveResult:
        return await self._call(self.actor.send_kv.remote(key, dst_key, reservation, timeout), timeout)

    async def forget_kv(self, key: str, start: int, timeout: float) -> bool:
        return await self._call(self.actor.forget_kv.remote(key, start), timeout)

    async def kv_digest(self, key: str, num_tokens: int, start: int, timeout: float) -> str:
        return await self._call(self.actor.kv_digest.remote(key, num_tokens, start), timeout)

    async def steps(self) -> AsyncIterator[StepOutput]:
        async for out in self._stream(self.actor.stream_steps.options(num_returns="streaming").remote(
                self.router_id), "step"):
            yield out
        raise WorkerError(self.worker_id, "step stream ended", Failure.ERROR)

    async def release_router(self, router_id: RouterId, timeout: float, final: bool = True) -> int:
        return await self._call(self.actor.release_router.remote(router_id, final), timeout)

    async def _stream(self, refs, what: str) -> AsyncIterator[Any]:
        """The items of a streaming actor call, with its failures as WorkerErrors."""
        import ray

        try:
            async for ref in refs:
                yield await ref
        except ray.exceptions.ActorUnavailableError as e:  # a subclass of RayActorError: test it first
            raise WorkerError(self.worker_id, f"{what} stream interrupted: {e}", Failure.UNAVAILABLE) from e
        except ray.exceptions.RayActorError as e:
            raise WorkerError(self.worker_id, f"{what} stream ended: {e}", Failure.LOST) from e
        except ray.exceptions.RayError as e:
            raise WorkerError(self.worker_id, f"{what} stream failed: {e}", Failure.ERROR) from e

    async def shutdown(self, timeout: float) -> EngineLoad | None:
        return await self._call(self.actor.shutdown.remote(), timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
