"""The transport interface: a KV sender on the prefill worker, a KV receiver on the decode worker.

Both are non-blocking: calls register or enqueue work and return; background threads move the bytes. Each
transfer is named by its request id and ends exactly once, DONE or FAILED, and its result (carrying the
caller's block ids, so the owner knows what to free) is handed out exactly once, by `wait` or
`pop_finished`. Ownership is the same on both sides: **the worker allocates the blocks, the worker frees
them, the transport never does**, and once the transport has reported a transfer finished it touches
those blocks no more.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.messages import PeerAddress


class TransferStatus(enum.IntEnum):
    """A transfer's life, in order; `is_finished` is one comparison."""

    PENDING = 0  # registered; no layer has moved yet
    TRANSFERRING = 1  # at least one layer has been sent (sender) or has landed (receiver)
    DONE = 2  # sender: the receiver acknowledged every layer; receiver: every layer landed
    FAILED = 3

    @property
    def is_finished(self) -> bool:
        return self >= TransferStatus.DONE


@dataclass(frozen=True)
class TransferResult:
    """How one transfer ended. `block_ids` are the caller's own blocks of the transfer (the sender's source
    blocks, or the receiver's destination blocks): the caller frees them when it sees this."""

    request_id: str
    status: TransferStatus
    block_ids: tuple[int, ...]
    error: str | None = None

    def __post_init__(self) -> None:
        assert self.status.is_finished, f"a result needs a finished status, got {self.status.name}"
        assert (self.error is not None) == (self.status == TransferStatus.FAILED), \
            f"error must be set exactly when the transfer failed: {self.status.name}, {self.error!r}"

    @property
    def ok(self) -> bool:
        return self.status == TransferStatus.DONE


class KVSender(ABC):
    """The prefill side. Pushes a request's KV blocks, layer by layer, into blocks a receiver reserved.

    Ownership: the prefill worker allocates the source blocks and keeps them allocated and unchanged from
    `begin` until the transfer's result is collected; the sender only reads them, and never after it has
    reported the transfer finished. It frees nothing. A failure (deadline passed, receiver refused, died or
    went silent, `abort`) leaves the source blocks as they were; the worker frees them either way.
    """

    endpoint_id: str  # this sender's name; the receiver's `expect(src=...)` names it

    @abstractmethod
    def connect(self, dst: PeerAddress) -> None:
        """Open the link to `dst` now, in the background, so the first transfer there does not wait for it
        (a drain warms its links before it moves anything). Optional: `begin` connects when needed."""

    @abstractmethod
    def begin(self, request_id: str, dst: PeerAddress, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], deadline: float) -> None:
        """Start a transfer of every layer of `src_block_ids` into the receiver's `dst_block_ids` (same
        length, position by position; leave out blocks the receiver already holds). `deadline` is a
        `time.monotonic()` instant of this process: layers not all sent by then, the transfer fails.

        The receiver decides whether the KV landed: once every layer is out, the sender waits for its
        verdict (ACK or NACK) even past the deadline, for as long as the link is alive (at most the
        config's `liveness_s + op_timeout_s` more), so both sides agree unless the link breaks in between."""

    @abstractmethod
    def extend(self, request_id: str, deadline: float) -> bool:
        """Move the transfer's deadline later (the prefill still makes progress). False once finished."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: int) -> None:
        """Layer `layer`'s KV is written: ship it. Returns at once (on CUDA it records an event on the
        current stream, so the copy waits for the compute). A no-op once the transfer has failed."""

    @abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """The transfer's status; KeyError once its result has been collected (or it never began)."""

    @abstractmethod
    def wait(self, request_id: str, timeout: float) -> TransferResult:
        """Block until the transfer finishes and collect its result; TimeoutError after `timeout` s."""

    @abstractmethod
    def pop_finished(self) -> list[TransferResult]:
        """Collect every finished, uncollected result (for a worker's step loop)."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by the sender") -> None:
        """Fail the transfer now (and tell the receiver); a no-op once finished."""

    @abstractmethod
    def close(self) -> None:
        """Fail what is in flight and release the links. Idempotent."""


class KVReceiver(ABC):
    """The decode side. Scatters incoming layers straight into blocks the decode worker reserved.

    Ownership: the decode worker reserves the destination blocks (its BlockAllocator), calls `expect`
    before it hands their ids out, and keeps them reserved until it collects the result. On DONE the KV is in
    place (and, on CUDA, visible to every stream); on FAILED (layout mismatch, deadline, sender death or
    abort) the contents of those blocks are undefined and the worker frees them. After reporting a transfer
    finished the receiver writes into its blocks no more: late layers are dropped.
    """

    endpoint_id: str

    @property
    @abstractmethod
    def address(self) -> PeerAddress:
        """What senders pass as `dst`."""

    @abstractmethod
    def expect(self, request_id: str, src: str, dst_block_ids: Sequence[int], deadline: float) -> None:
        """Accept a transfer of `request_id` from the sender named `src` into `dst_block_ids`. `deadline`
        is a `time.monotonic()` instant of this process."""

    @abstractmethod
    def extend(self, request_id: str, deadline: float) -> bool:
        """Move the transfer's deadline later: the decode worker holds a reservation as a lease that the
        router renews while the prompt's prefill makes progress. False once the transfer has finished."""

    @abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """As `KVSender.poll`."""

    @abstractmethod
    def wait(self, request_id: str, timeout: float) -> TransferResult:
        """As `KVSender.wait`."""

    @abstractmethod
    def pop_finished(self) -> list[TransferResult]:
        """As `KVSender.pop_finished`."""

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by the receiver") -> None:
        """Fail the transfer now (the sender hears of it at its next message); a no-op once finished."""

    @abstractmethod
    def close(self) -> None:
        """Fail what is in flight, stop accepting links. Idempotent."""
