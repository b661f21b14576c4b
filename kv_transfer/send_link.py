"""One link to one receiver, as the sender's link thread sees it: the ordered queue of what to send, the
transfers on the link by seq, and how a batch of layers is taken off the queue and packed into a payload.

`kv_transfer.sender.LayerwiseSender` owns the links and every state change (under its book's lock); what
is here touches only one link's queue, or one transfer's source blocks under its `io_lock`.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.kv_cache import KVCache
from kv_transfer.book import TransferState
from kv_transfer.layout import TransferDescriptor, pack_layers
from protocol.messages import PeerAddress


class SendOp(enum.Enum):
    BEGIN = enum.auto()
    LAYER = enum.auto()
    ABORT = enum.auto()
    STOP = enum.auto()  # close the link politely (BYE)
    WAKE = enum.auto()  # the link died elsewhere: let the send loop notice


@dataclass(eq=False)
class SendState(TransferState):
    descriptor: TransferDescriptor | None = None
    src_index: torch.Tensor | None = None  # [num_blocks] int64 on the cache's device
    link: LinkWorker | None = None
    seq: int = -1
    layers_requested: set[int] = field(default_factory=set)
    layers_sent: int = 0
    awaiting_verdict: bool = False  # every layer was out at the deadline: the receiver's ACK/NACK decides


class SendItem(NamedTuple):
    op: SendOp
    state: SendState | None = None
    layer: int = 0
    event: torch.cuda.Event | None = None  # CUDA: recorded on the compute stream after the layer was written
    reason: str = ""


class LinkWorker:
    """One link to one receiver: the outgoing queue, the transfers on it by seq, and its threads."""

    def __init__(self, dst: PeerAddress) -> None:
        self.dst = dst
        self.queue: queue.SimpleQueue[SendItem] = queue.SimpleQueue()
        self.backlog: deque[SendItem] = deque()  # taken out of the queue while coalescing, not yet sent
        self.transfers: dict[int, SendState] = {}
        self.next_seq = 0
        self.dead = False
        self.connected = False
        self.thread: threading.Thread | None = None

    def next_item(self, timeout: float | None) -> SendItem | None:
        """The next item in order (the backlog holds items taken out but not yet sent); None on timeout."""
        if self.backlog:
            return self.backlog.popleft()
        try:
            return self.queue.get_nowait() if timeout is None else self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def coalesce(self, first: SendItem, max_bytes: int) -> list[SendItem]:
        """`first` and the consecutive layers of its transfer already waiting behind it.

        NOTE: when the link falls behind the model, the layers that piled up go out as one message (fewer,
        larger messages: the per-message cost dominates otherwise); when the model is the slower one, each
        layer still leaves alone, the moment it is offered. Nothing ever waits for more layers."""
        assert first.state is not None and first.state.descriptor is not None
        batch = [first]
        limit = max(1, max_bytes // first.state.descriptor.layer_nbytes)
        while len(batch) < limit:
            nxt = self.next_item(None)
            if nxt is None:
                break
            if nxt.op is not SendOp.LAYER or nxt.state is not first.state or nxt.layer != batch[-1].layer + 1:
                self.backlog.appendleft(nxt)
                break
            batch.append(nxt)
        return batch


def pack_batch(cache: KVCache, stream: torch.cuda.Stream | None, state: SendState, first: int,
               events: list[torch.cuda.Event | None], out: torch.Tensor) -> None:
    """Gather layers [first, first + len(events)) of the transfer's blocks into `out` (flat uint8, on the
    link's payload device), complete when this returns. On CUDA, `stream` is the sender's packing stream and
    `events` mark each layer's write on the compute stream."""
    assert state.src_index is not None and state.descriptor is not None
    shape = (len(events), *state.descriptor.layer_shape)  # [count, 2, n, block_size, heads, head_dim]
    dest = out.view(cache.tensor.dtype).view(shape)
    if stream is None:
        pack_layers(cache.tensor, first, len(events), state.src_index, out=dest)
        return
    with torch.cuda.stream(stream):
        for event in events:
            assert event is not None
            stream.wait_event(event)
        if dest.device == cache.device:
            pack_layers(cache.tensor, first, len(events), state.src_index, out=dest)
        else:
            dest.copy_(pack_layers(cache.tensor, first, len(events), state.src_index))
        # NOTE: synchronous, so that a failed transfer's blocks are never read after it is reported
        # and the send (on another stream) sees finished data.
        stream.synchronize()
