"""The bookkeeping both ends share: transfers in flight, their deadlines, and results waiting to be collected.

One lock (a Condition) guards an endpoint's tables; each transfer also has an `io_lock`, held while the
transport reads its source blocks or writes its destination blocks. That is what makes "finished means
hands off" true: a transfer is marked finished only under its io_lock, and the transport checks the status
under the io_lock before every block access. Lock order: the book's lock, then an io_lock, never the reverse.
A single watchdog thread per endpoint fails transfers whose deadline passed, independently of whatever
the link threads are blocked on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kv_transfer.base import TransferResult, TransferStatus

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TransferState:
    """One transfer's mutable state; guarded by its book's lock."""

    request_id: str
    peer_id: str  # the other side's endpoint id
    block_ids: tuple[int, ...]  # this side's blocks, handed back in the result
    deadline: float  # time.monotonic()
    status: TransferStatus = TransferStatus.PENDING
    error: str | None = None
    # NOTE: held while the transport reads or writes this transfer's blocks, and taken (inside `lock`) to mark
    # it finished. A per-transfer lock, so packing one layer never stalls the model thread's `send_layer`.
    io_lock: threading.Lock = field(default_factory=threading.Lock)


S = TypeVar("S", bound=TransferState)


class TransferBook(Generic[S]):
    """Transfers of one endpoint by request id. Methods named `_locked` expect the caller to hold `lock`."""

    def __init__(self, name: str, on_expire: Callable[[S], None]) -> None:
        self.lock = threading.Condition()
        # called under the lock at the deadline; must finish the transfer (or move its deadline on) and not block
        self._on_expire = on_expire
        self._name = name
        self._active: dict[str, S] = {}
        self._finished: dict[str, TransferResult] = {}  # insertion order = finishing order
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-deadlines", daemon=True)
        self._watchdog.start()

    def add_locked(self, state: S) -> None:
        if state.request_id in self._active or state.request_id in self._finished:
            raise ValueError(f"request_id {state.request_id!r} is already in flight or its result is uncollected")
        self._active[state.request_id] = state
        self.lock.notify_all()

    def get_locked(self, request_id: str) -> S | None:
        return self._active.get(request_id)

    def active_locked(self) -> list[S]:
        return list(self._active.values())

    def is_finished_locked(self, request_id: str) -> bool:
        return request_id in self._finished

    def finish_locked(self, state: S, error: str | None) -> bool:
        """Mark the transfer DONE (error None) or FAILED; False if it had already finished."""
        with state.io_lock:
            if state.status.is_finished:
                return False
            state.status = TransferStatus.DONE if error is None else TransferStatus.FAILED
            state.error = error
        del self._active[state.request_id]
        self._finished[state.request_id] = TransferResult(state.request_id, state.status, state.block_ids, error)
        self.lock.notify_all()
        return True

    def poll(self, request_id: str) -> TransferStatus:
        with self.lock:
            state = self._active.get(request_id)
            if state is not None:
                return state.status
            result = self._finished.get(request_id)
            if result is None:
                raise KeyError(f"no transfer {request_id!r} (never begun, or its result was collected)")
            return result.status

    def wait(self, request_id: str, timeout: float) -> TransferResult:
        with self.lock:
            if request_id not in self._active and request_id not in self._finished:
                raise KeyError(f"no transfer {request_id!r} (never begun, or its result was collected)")
            if not self.lock.wait_for(lambda: request_id not in self._active, timeout):
                raise TimeoutError(f"transfer {request_id!r} unfinished after {timeout:.3g}s")
            if request_id not in self._finished:
                raise KeyError(f"transfer {request_id!r} finished but its result was collected elsewhere")
            return self._finished.pop(request_id)

    def pop_finished(self) -> list[TransferResult]:
        with self.lock:
            results = list(self._finished.values())
            self._finished.clear()
            return results

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.lock.notify_all()
        self._watchdog.join(timeout=1.0)

    def _watch(self) -> None:
        with self.lock:
            while not self._closed:
                now = time.monotonic()
                for state in [s for s in self._active.values() if s.deadline <= now]:
                    try:
                        self._on_expire(state)
                    except Exception:  # a bug: the watchdog must live on, or no deadline fires again
                        log.exception("%s: on_expire failed for %r", self._name, state.request_id)
                    if not state.status.is_finished and state.deadline <= now:  # never spin on it
                        log.error("%s: %r still unfinished at its deadline", self._name, state.request_id)
                        self.finish_locked(state, f"transfer {state.request_id!r}: deadline passed")
                next_deadline = min((s.deadline for s in self._active.values()), default=None)
                self.lock.wait(None if next_deadline is None else max(0.0, next_deadline - time.monotonic()))


class BookKeeper:
    """The half of a sender or receiver that only consults its book: `poll`, `wait`, `pop_finished` and
    the locking part of `abort`. Both cores inherit it; each supplies `_fail_locked`."""

    _book: TransferBook

    def poll(self, request_id: str) -> TransferStatus:
        return self._book.poll(request_id)

    def wait(self, request_id: str, timeout: float) -> TransferResult:
        return self._book.wait(request_id, timeout)

    def pop_finished(self) -> list[TransferResult]:
        return self._book.pop_finished()

    def extend(self, request_id: str, deadline: float) -> bool:
        """Move an unfinished transfer's deadline later (a lease renewed); False if it is not in flight."""
        with self._book.lock:
            state = self._book.get_locked(request_id)
            if state is None:
                return False
            if deadline > state.deadline:
                state.deadline = deadline
            return True

    def _abort(self, request_id: str, reason: str) -> None:
        with self._book.lock:
            state = self._book.get_locked(request_id)
            if state is not None:
                self._fail_locked(state, f"transfer {request_id!r}: {reason}", tell_peer=True)

    def _fail_locked(self, state: TransferState, reason: str, tell_peer: bool) -> None:
        raise NotImplementedError
