"""`pdserve serve`'s process: start the `Server`, serve until SIGTERM or SIGINT, then drain and stop, all
within the shutdown grace counted from the signal, start-up included.

Of the grace, `_STOP_RESERVE_S` is kept back from the drain for stopping the workers and the Ray cluster;
past the grace, the workers the server started are killed, so a signal never leaves a process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

from control.config import ServeConfig
from control.console import log
from control.ray_cluster import init_ray
from control.server import Server

# of the shutdown grace, what is kept back from the drain for stopping the workers and the Ray cluster
_STOP_RESERVE_S = 8.0


async def serve_forever(config: ServeConfig) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully (see `Server.shutdown`), all within
    `config.shutdown_grace` of the signal, start-up included: a signal while the workers load kills them."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signalled_at: list[float] = []  # loop time of the first signal

    def on_signal() -> None:
        if not signalled_at:
            signalled_at.append(loop.time())
        stop.set()

    init_ray(config.ray_address, config.num_workers)
    # NOTE: after `init_ray`: Ray installs its own SIGTERM handler (it dumps a stack and dies) in `ray.init`
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    server = Server(config)
    signalled = asyncio.ensure_future(stop.wait())

    def deadline() -> float:
        return signalled_at[0] + config.shutdown_grace if signalled_at else loop.time() + _STOP_RESERVE_S

    try:
        if await _start_unless_signalled(server, signalled):
            await asyncio.wait([signalled, asyncio.ensure_future(server.stopped.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            if signalled.done():
                log("signal received: draining")
                await _stop_by(server.shutdown(_drain_budget(config.shutdown_grace)), server, deadline())
    finally:
        # idempotent: a no-op after a graceful shutdown; stops a failed or interrupted start
        await _stop_by(server.stop(), server, deadline())
        signalled.cancel()


async def _start_unless_signalled(server: Server, signalled: asyncio.Future) -> bool:
    """Start `server`; True once it serves. A signal first: kill the workers being started and say False.

    NOTE: a start waits for every worker to load its model (a minute for 1P+2D on this 2-core machine), and
    the pool manager lets every worker start run to its end even when its start is cancelled: killing the
    actors is what makes those starts end now."""
    starting = asyncio.ensure_future(server.start())
    await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a failed start raises here (ServeError: the message says what to change)
        return True
    log("signal received during start-up: stopping the workers being started")
    server.kill_workers_now()
    starting.cancel()
    with contextlib.suppress(BaseException):  # cancelled, or failed as its workers died: either is expected
        await asyncio.wait_for(starting, _STOP_RESERVE_S)
    return False


async def _stop_by(stopping: Coroutine[Any, Any, None], server: Server, deadline: float) -> None:
    """Run `stopping` (the server's shutdown or stop) until `deadline` (loop time, less a second for the Ray
    cluster to go down); past it, or after it, kill the workers the server started."""
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(stopping, max(0.0, deadline - loop.time() - 1.0))
    except asyncio.TimeoutError:
        log("shutting down: stopping took past the shutdown grace; killing the workers")
    server.kill_workers_now()  # (no-op for workers the stop ended; catches any launched while it ran)


def _drain_budget(grace_s: float) -> float:
    """Of the shutdown grace, how long in-flight requests may take: the rest stops the workers and Ray."""
    return max(0.0, grace_s - min(_STOP_RESERVE_S, grace_s / 2))
