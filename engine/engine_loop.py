"""An engine's step loop on its own thread, driven by commands from other threads.

A worker actor's event loop must stay responsive (new requests, cancels, KV-transfer notices) while the
model computes, and the engine is not thread-safe. So the engine is touched only by this loop's thread:
other threads hand it closures with `call`, which run between steps, and receive each step's tokens through
`on_step` (one `StepOutput` per step, for every sequence that got a token in it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.llm_engine import EngineLoad, LayerHookFactory, LLMEngine
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last delta of a request
    num_cached_tokens: int = 0


@dataclass
class StepOutput:
    step: int
    time: float  # when the step's tokens were sampled (time.time(), comparable across processes)
    deltas: list[TokenDelta] = field(default_factory=list)
    load: EngineLoad | None = None


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutput], None],
                 poll: Callable[[], bool] | None = None, layer_hook_for: LayerHookFactory | None = None,
                 name: str = "engine-loop") -> None:
        """`poll` runs before every step (KV transfers to check) and returns whether it is still waiting
        on something, in which case an idle loop polls again soon instead of sleeping."""
        self.engine = engine
        self.on_step = on_step
        self.poll = poll
        self.layer_hook_for = layer_hook_for
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wake the loop
        self._thread.join(timeout)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the loop thread between steps; its result or exception lands in the future."""
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        return fut

    def _drain(self, wait: float) -> None:
        try:
            fn, fut = self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller gets it through the future
                    fut.set_exception(e)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        stalled = False  # the last step could schedule nothing (every block held): don't spin on it
        while not self._stop.is_set():
            waiting_on_io = self.poll() if self.poll is not None else False
            idle = stalled or not self.engine.has_scheduled_work()
            # NOTE: idle with a transfer in flight, poll again within a millisecond: its completion is
            # what the next request's first token (or decode admission) waits on.
            self._drain((0.001 if waiting_on_io or stalled else 0.05) if idle else 0)
            if not self.engine.has_scheduled_work():
                continue
            try:
                out, advanced = self.engine.step(self.layer_hook_for)
            except Exception:  # a failed step must not hang its requests: end them all with an error
                logger.exception("engine step failed; failing every request in this engine")
                self.on_step(self._fail_all())
                continue
            stalled = not out.chunks
            self._steps += 1
            deltas = [self._delta(r) for r in advanced]
            # requests the scheduler ended without running them (grown past the whole cache)
            deltas += [TokenDelta(r.request_id, [], r.finish_reason.value, r.num_cached_tokens)
                       for r in out.finished]
            if deltas:
                self.on_step(StepOutput(self._steps, time.time(), deltas, self.engine.load()))

    @staticmethod
    def _delta(r: Request) -> TokenDelta:
        reason = r.finish_reason
        return TokenDelta(r.request_id, [r.output_token_ids[-1]], None if reason is None else reason.value,
                          r.num_cached_tokens)

    def _fail_all(self) -> StepOutput:
        sched = self.engine.scheduler
        failed = list(sched.requests.values())
        for r in failed:
            sched.finish(r, RequestStatus.FINISHED_ERROR)
        return StepOutput(self._steps, time.time(), [TokenDelta(r.request_id, [], "error") for r in failed],
                          self.engine.load())
