"""Stalled streams: a client that stops taking tokens must not pin KV blocks forever.

Each front door hands a request's tokens to its client at one place (the `yield` of the gRPC servicer's
`Generate`, the SSE writer of the HTTP door). Before the hand-over the door stamps `Handover.blocked_since`;
when the transport has taken the message it clears it. A transport takes a message as long as the client
keeps reading: HTTP/2 and TCP flow control make the write wait once the client's window (gRPC) or the
socket buffers (HTTP) are full. So a stream whose hand-over has been blocked for `timeout_s` is one whose
client has not taken a token for that long: `StallWatch` (one sweeper task per door) cancels it.

Cancelling ends the task writing to the client (the write is abandoned, the RPC or the connection ends)
and then closes the stream's `stream_text` generator, which ends the router's stream: both pools free the
request's blocks (`Router._end_attempt`).

What "moving" means: a client that reads at least one flow-control window's worth of messages (gRPC: the
HTTP/2 stream window, 64 KiB by default and grown by BDP probing; HTTP: the socket buffers) within the
timeout never has a hand-over blocked that long, however slow it is. Meanwhile the router pauses its
sequence on the decode worker after `max_buffered_steps` undelivered steps (`router.step_streams`), so a
slow reader costs its blocks but no compute, and is never cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["Handover", "StallWatch"]


@dataclass(eq=False)
class Handover:
    """One stream's hand-over to its client, as the sweeper sees it."""

    task: asyncio.Task  # the task writing the stream to the client (cancelled when it stalls)
    chunks: AsyncGenerator  # its `stream_text` generator: closing it frees the request's blocks
    door: str  # "grpc" or "http": the metric's label
    blocked_since: float | None = None  # monotonic time the current hand-over began; None between them
    stalled: bool = False  # set when the sweeper cancels it (the door then ends quietly)


class StallWatch:
    """Cancels the streams whose client has not taken a message for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, on_stalled: Callable[[str], None] = lambda door: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_stalled(door)`: called once per stream cancelled (the metric); `clock`: monotonic seconds."""
        if not timeout_s > 0:
            raise ValueError(f"--stalled-stream-timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.on_stalled = on_stalled
        self.clock = clock
        self._streams: set[Handover] = set()
        self._sweeper: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()

    def watch(self, chunks: AsyncGenerator, door: str) -> Handover:
        """Watch the stream the current task writes to its client; `forget` it when the stream ends."""
        task = asyncio.current_task()
        assert task is not None, "watch() runs inside the task that writes the stream"
        handover = Handover(task, chunks, door)
        self._streams.add(handover)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())
        return handover

    def forget(self, handover: Handover) -> None:
        self._streams.discard(handover)

    @property
    def num_watched(self) -> int:
        return len(self._streams)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for task in list(self._closing):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task

    async def _sweep(self) -> None:
        # NOTE: a quarter of the timeout between sweeps: a stall is caught within 1.25x the timeout, and an
        # idle door costs four wake-ups per timeout. The sweeper ends when nothing is left to watch.
        period = max(self.timeout_s / 4, 0.01)
        while self._streams:
            await asyncio.sleep(period)
            now = self.clock()
            for h in list(self._streams):
                if h.blocked_since is not None and now - h.blocked_since >= self.timeout_s and not h.stalled:
                    self._cancel(h)

    def _cancel(self, h: Handover) -> None:
        h.stalled = True
        self._streams.discard(h)
        # NOTE: the cancellation lands at the write the task is blocked in, outside the stream generators,
        # so the task never resumes them; they are closed here, from outside, which is then safe
        h.task.cancel()
        task = asyncio.ensure_future(self._close_chunks(h))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        self.on_stalled(h.door)
        logger.warning("a %s stream's client took no token for %.1f s (--stalled-stream-timeout): cancelled, "
                       "its blocks freed", h.door, self.timeout_s)

    @staticmethod
    async def _close_chunks(h: Handover) -> None:
        try:
            await h.chunks.aclose()
        except RuntimeError:
            # NOTE: "already running": the write finished just as it was cancelled and the task is inside the
            # generator; its own cancellation closes the stream there
            pass
        except Exception:  # noqa: BLE001 - the router logs its own failures; the stream is over either way
            logger.exception("closing a stalled stream failed")
