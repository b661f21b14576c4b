"""An engine's step loop on its own thread, driven by commands from other threads.

A worker actor's event loop must stay responsive (new requests, cancels, KV-transfer notices) while the
model computes, and the engine is not thread-safe. So the engine is touched only by this loop's thread:
other threads hand it closures with `call`, which run between steps, and receive each step's tokens through
`on_step` (one `StepOutput` per step, for every sequence that got a token in it).

Liveness: the loop stamps `last_progress` after every model layer, every step and every idle wait, so the
actor's own thread can tell the router whether the engine still moves (`heartbeat`). Per layer, because
one step of a long prompt's chunk can take longer than any sensible liveness timeout on a slow machine,
while one layer of it cannot. An exception the loop cannot attribute to
one step (in `poll`, `on_step`, the scheduler's bookkeeping) is fatal: `on_fatal` runs, whose default ends
the process, so Ray sees a dead actor instead of a live one with a dead engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.backend import EngineBackend, EngineDead, LayerHook, LayerHookFactory
from engine.request import Request, RequestStatus
from engine.scheduler import SchedulerOutput
from protocol.kinds import FinishReason
from protocol.messages import StepOutput, TokenDelta

logger = logging.getLogger(__name__)
T = TypeVar("T")

# the exit status of a worker process whose engine loop died (EX_SOFTWARE)
FATAL_EXIT_CODE = 70


def _exit_process(error: BaseException) -> None:
    logger.critical("engine loop died (%r); ending the worker process so its supervisor sees it", error)
    logging.shutdown()
    os._exit(FATAL_EXIT_CODE)


class EngineLoop:
    def __init__(self, engine: EngineBackend, on_step: Callable[[StepOutput], None],
                 poll: Callable[[], bool] | None = None, layer_hook_for: LayerHookFactory | None = None,
                 on_fail: Callable[[list[Request]], None] | None = None,
                 on_fatal: Callable[[BaseException], None] = _exit_process,
                 name: str = "engine-loop") -> None:
        """`poll` runs before every step (KV transfers to check) and returns whether it is still waiting
        on something, in which case an idle loop polls again soon instead of sleeping. `on_fail` sees the
        requests a failed step is about to end, before their blocks are freed (a worker fails their KV
        transfers first, so no receiver writes into freed blocks)."""
        self.engine = engine
        self.on_step = on_step
        self.poll = poll
        self.layer_hook_for = layer_hook_for
        self.on_fail = on_fail
        self.on_fatal = on_fatal
        self.last_progress = time.monotonic()
        self.waiting_on_io = False
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wake the loop
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """Work scheduled or transfers in flight (read from another thread: a hint, not a lock)."""
        return self.waiting_on_io or self.engine.has_scheduled_work()

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
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - anything that escapes a step's own handling is fatal
            self.on_fatal(e)

    def _loop(self) -> None:
        stalled = False  # the last step could schedule nothing (every block held): don't spin on it
        while not self._stop.is_set():
            self.waiting_on_io = self.poll() if self.poll is not None else False
            idle = stalled or not self.engine.has_scheduled_work()
            # NOTE: idle with a transfer in flight, poll again within a millisecond: its completion is
            # what the next request's first token (or decode admission) waits on.
            # NOTE: a stalled step (nothing could run: every block held, or only prompts held for their KV
            # destination) resumes on a command, which wakes the drain at once, or on a transfer, polled
            # every millisecond as above: otherwise 10 ms, so a long wait for a destination spins no core
            self._drain((0.001 if self.waiting_on_io else 0.01 if stalled else 0.05) if idle else 0)
            self.last_progress = time.monotonic()
            if not self.engine.has_scheduled_work():
                continue
            try:
                out, advanced = self.engine.step(self._hook_for)
            except EngineDead:
                raise  # fatal: the worker ends and is replaced (its requests move)
            except Exception:  # a failed step must not hang its requests: end them all with an error
                logger.exception("engine step failed; failing every request in this engine")
                self.on_step(self._fail_all())
                continue
            self.last_progress = time.monotonic()
            stalled = not out.chunks
            self._steps += 1
            deltas = [self._delta(r) for r in advanced]
            # requests the scheduler ended without running them (grown past the whole cache)
            deltas += [TokenDelta(r.request_id, [], r.finish_reason, r.num_cached_tokens,
                                  error="the sequence outgrew the whole KV cache")
                       for r in out.finished]
            if deltas:
                self.on_step(StepOutput(self._steps, time.time(), deltas, self.engine.load(),
                                        self.engine.last_step))

    def _hook_for(self, out: SchedulerOutput) -> LayerHook:
        """Every layer stamps progress, then runs the worker's own hook for this step (if any)."""
        inner = self.layer_hook_for(out) if self.layer_hook_for is not None else None

        def hook(layer: int) -> None:
            self.last_progress = time.monotonic()
            if inner is not None:
                inner(layer)

        return hook

    @staticmethod
    def _delta(r: Request) -> TokenDelta:
        reason = r.finish_reason
        return TokenDelta(r.request_id, r.output_token_ids[-r.num_new_tokens:],
                          reason, r.num_cached_tokens)

    def _fail_all(self) -> StepOutput:
        failed = list(self.engine.requests.values())
        if self.on_fail is not None:
            self.on_fail(failed)
        for r in failed:
            self.engine.finish(r, RequestStatus.FINISHED_ERROR)
        return StepOutput(self._steps, time.time(),
                          [TokenDelta(r.request_id, [], FinishReason.ERROR, error="the engine step failed") for r in failed],
                          self.engine.load())
