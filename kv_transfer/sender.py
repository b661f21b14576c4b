"""The sender core, shared by every transport: layer-wise push over one link per receiver.

`begin` registers a transfer and queues its descriptor; `send_layer` (called by the model right after a
layer's KV is written) queues that layer and returns. Per receiver, one link thread connects, then drains
the queue in order: it packs each layer's source blocks into one buffer (`index_select`) and hands it to
the link, so the transfer runs while the model computes the next layers (consecutive layers that are
already waiting go out together, up to the link's message size, see `_coalesce`); a second thread reads
the receiver's replies (ACK finishes a transfer, NACK fails it). Many transfers share the link, told
apart by their `seq`. The receiver decides whether a transfer landed: see `_on_expire`.

A transport subclass only says how to open a link (`_connect`); everything about transfers lives here.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.kv_cache import KVCache
from kv_transfer.base import KVSender, TransferStatus
from kv_transfer.book import BookKeeper, TransferBook, TransferState
from kv_transfer.config import KVTransferConfig
from kv_transfer.layout import TransferDescriptor, pack_layers
from kv_transfer.wire import Header, LinkError, MsgKind, SendLink, bytes_tensor
from protocol.messages import PeerAddress

log = logging.getLogger(__name__)


class _Op(enum.Enum):
    BEGIN = enum.auto()
    LAYER = enum.auto()
    ABORT = enum.auto()
    STOP = enum.auto()  # close the link politely (BYE)
    WAKE = enum.auto()  # the link died elsewhere: let the send loop notice


@dataclass(eq=False)
class _SendState(TransferState):
    descriptor: TransferDescriptor | None = None
    src_index: torch.Tensor | None = None  # [num_blocks] int64 on the cache's device
    link: _LinkWorker | None = None
    seq: int = -1
    layers_requested: set[int] = field(default_factory=set)
    layers_sent: int = 0
    awaiting_verdict: bool = False  # every layer was out at the deadline: the receiver's ACK/NACK decides


class _Item(NamedTuple):
    op: _Op
    state: _SendState | None = None
    layer: int = 0
    event: torch.cuda.Event | None = None  # CUDA: recorded on the compute stream after the layer was written
    reason: str = ""


class _LinkWorker:
    """One link to one receiver: the outgoing queue, the transfers on it by seq, and its threads."""

    def __init__(self, dst: PeerAddress) -> None:
        self.dst = dst
        self.queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.backlog: deque[_Item] = deque()  # taken out of the queue while coalescing, not yet sent
        self.transfers: dict[int, _SendState] = {}
        self.next_seq = 0
        self.dead = False
        self.connected = False
        self.thread: threading.Thread | None = None


class LayerwiseSender(BookKeeper, KVSender):
    """Transport-independent `KVSender`; subclasses implement `_connect`."""

    transport: str  # which PeerAddress.transport this sender can reach

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig) -> None:
        if not endpoint_id:
            raise ValueError("endpoint_id must name this sender")
        self.endpoint_id = endpoint_id
        self.cache = cache
        self.config = config
        self._book: TransferBook[_SendState] = TransferBook(f"kv-send-{endpoint_id}", self._on_expire)
        self._lock = self._book.lock
        self._links: dict[tuple[str, str], _LinkWorker] = {}  # (endpoint_id, incarnation) -> link
        self._workers: list[_LinkWorker] = []  # every link whose thread may still run, broken ones too
        self._closed = False
        # NOTE: packing runs on its own stream so it overlaps the next layers' compute; it waits for the
        # layer's compute through the event `send_layer` records.
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None

    @abstractmethod
    def _connect(self, dst: PeerAddress) -> SendLink:
        """Open a link to `dst`, blocking at most `connect_timeout_s`; runs on the link's own thread."""

    # ---- the worker's API ----

    def connect(self, dst: PeerAddress) -> None:
        if dst.transport != self.transport:
            raise ValueError(f"dst is a {dst.transport!r} receiver; this sender speaks {self.transport!r}")
        with self._lock:
            if not self._closed:
                self._link_for_locked(dst)

    def begin(self, request_id: str, dst: PeerAddress, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], deadline: float) -> None:
        if dst.transport != self.transport:
            raise ValueError(f"dst is a {dst.transport!r} receiver; this sender speaks {self.transport!r}")
        src, dst_ids = tuple(int(b) for b in src_block_ids), tuple(int(b) for b in dst_block_ids)
        if len(src) != len(dst_ids):
            raise ValueError(f"src_block_ids ({len(src)}) and dst_block_ids ({len(dst_ids)}) must pair up")
        bad = [b for b in src if not 0 <= b < self.cache.num_blocks]
        if bad:
            raise ValueError(f"src_block_ids {bad} outside the cache's {self.cache.num_blocks} blocks")
        state = _SendState(request_id, dst.endpoint_id, src, deadline)
        if src:
            state.descriptor = TransferDescriptor.for_spec(request_id, self.cache.spec, dst_ids)
            state.src_index = torch.tensor(src, dtype=torch.int64, device=self.cache.device)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KV sender {self.endpoint_id!r} is closed")
            self._book.add_locked(state)
            if not src:  # everything was in the receiver's prefix cache
                self._book.finish_locked(state, None)
                return
            link = self._link_for_locked(dst)
            state.link, state.seq = link, link.next_seq
            link.next_seq += 1
            link.transfers[state.seq] = state
            link.queue.put(_Item(_Op.BEGIN, state))

    def send_layer(self, request_id: str, layer: int) -> None:
        with self._lock:
            state = self._book.get_locked(request_id)
            if state is None:
                if self._book.is_finished_locked(request_id):
                    return  # failed (or had nothing to ship): the model keeps computing regardless
                raise KeyError(f"send_layer for {request_id!r}, which was never begun")
            if not 0 <= layer < self.cache.spec.num_layers:
                raise ValueError(f"layer {layer} outside [0, {self.cache.spec.num_layers})")
            if layer in state.layers_requested:
                raise ValueError(f"layer {layer} of {request_id!r} was already sent")
            state.layers_requested.add(layer)
            event = None
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record()  # on the caller's (compute) stream
            assert state.link is not None
            state.link.queue.put(_Item(_Op.LAYER, state, layer, event))

    def abort(self, request_id: str, reason: str = "aborted by the sender") -> None:
        self._abort(request_id, reason)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for state in self._book.active_locked():
                self._fail_locked(state, f"transfer {state.request_id!r}: sender closed", tell_peer=True)
            for link in self._links.values():
                link.queue.put(_Item(_Op.STOP))
            self._links.clear()
            workers = [w for w in self._workers if w.thread is not None and w.thread.is_alive()]
        # NOTE: every link thread still running is joined, broken links' too (they may be tearing down):
        # one left inside gloo when the interpreter exits aborts the process. A link still connecting
        # cannot be interrupted (it waits in the store); it ends by itself within connect_timeout_s, with
        # nothing left to fail. The timeout is a generous bound on an orderly close, not a hard one.
        deadline = time.monotonic() + 4 * self.config.op_timeout_s + self.config.liveness_s
        for w in workers:
            if w.connected or w.dead:
                assert w.thread is not None
                w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._book.close()

    # ---- state changes (caller holds self._lock) ----

    def _finish_locked(self, state: _SendState, error: str | None) -> bool:
        if not self._book.finish_locked(state, error):
            return False
        if state.link is not None:
            state.link.transfers.pop(state.seq, None)
        return True

    def _fail_locked(self, state: _SendState, reason: str, tell_peer: bool) -> None:
        if self._finish_locked(state, reason) and tell_peer and state.link is not None and not state.link.dead:
            state.link.queue.put(_Item(_Op.ABORT, state, reason=reason))

    def _on_expire(self, state: _SendState) -> None:
        total = self.cache.spec.num_layers
        if state.layers_sent == total and not state.awaiting_verdict:
            # NOTE: everything is out: whether it landed in time is the receiver's call (a layer arriving
            # after its deadline never lands there). Wait for its ACK or NACK while the link lives, so the
            # two sides do not disagree over an ACK that was merely slow to come back.
            state.awaiting_verdict = True
            state.deadline = time.monotonic() + self.config.liveness_s + self.config.op_timeout_s
            return
        what = (f"all {total} layers sent but no verdict from the receiver "
                f"{self.config.liveness_s + self.config.op_timeout_s:.3g}s later" if state.awaiting_verdict
                else f"{state.layers_sent}/{total} layers sent")
        self._fail_locked(state, f"transfer {state.request_id!r} to {state.peer_id!r}: deadline passed with "
                                 f"{what}", tell_peer=True)

    def _link_for_locked(self, dst: PeerAddress) -> _LinkWorker:
        key = (dst.endpoint_id, dst.incarnation)
        link = self._links.get(key)
        if link is None or link.dead:
            link = _LinkWorker(dst)
            self._links[key] = link
            link.thread = threading.Thread(target=self._run_link, args=(link,), daemon=True,
                                           name=f"kv-send-{self.endpoint_id}->{dst.endpoint_id}")
            link.thread.start()
            self._workers = [w for w in self._workers if w.thread is not None and w.thread.is_alive()] + [link]
        return link

    def _link_failed(self, w: _LinkWorker, reason: str) -> None:
        with self._lock:
            if w.dead:
                return
            w.dead = True
            key = (w.dst.endpoint_id, w.dst.incarnation)
            if self._links.get(key) is w:
                del self._links[key]
            for state in list(w.transfers.values()):
                self._finish_locked(state, f"transfer {state.request_id!r}: link to receiver "
                                           f"{w.dst.endpoint_id!r} broke: {reason}")
            w.queue.put(_Item(_Op.WAKE))

    # ---- the link's threads ----

    def _run_link(self, w: _LinkWorker) -> None:
        try:
            link = self._connect(w.dst)
        except Exception as e:  # any failure to connect fails the link's transfers, and only those
            self._link_failed(w, f"cannot connect: {e}")
            return
        w.connected = True
        replies = threading.Thread(target=self._run_replies, args=(w, link), daemon=True,
                                   name=f"kv-acks-{self.endpoint_id}<-{w.dst.endpoint_id}")
        replies.start()
        try:
            self._send_loop(w, link)
        except LinkError as e:
            self._link_failed(w, str(e))
        except Exception as e:  # a bug or an allocation failure must not leave transfers waiting
            log.exception("KV sender %s: link to %s failed", self.endpoint_id, w.dst.endpoint_id)
            self._link_failed(w, f"internal error: {e!r}")
        finally:
            replies.join(timeout=self.config.liveness_s)
            link.close()

    def _send_loop(self, w: _LinkWorker, link: SendLink) -> None:
        next_ping = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_ping:  # NOTE: also while busy, so the receiver's replies never go quiet
                link.send(Header(MsgKind.PING), None)
                next_ping = now + self.config.keepalive_s
            if not w.backlog and w.queue.empty():
                link.idle()  # going idle: let batched messages go (and surface a broken link now)
            item = self._next_item(w, max(0.0, next_ping - time.monotonic()))
            if item is None:
                continue
            if w.dead:
                return
            if item.op is _Op.STOP:
                link.send(Header(MsgKind.BYE), None)
                link.flush()
                return
            if item.op is _Op.BEGIN:
                self._send_begin(link, item)
            elif item.op is _Op.ABORT:
                self._send_abort(link, item)
            elif item.op is _Op.LAYER:
                self._send_layers(link, self._coalesce(w, item, link.max_message_bytes))

    def _next_item(self, w: _LinkWorker, timeout: float | None) -> _Item | None:
        """The next item in order (the backlog holds items taken out but not yet sent); None on timeout."""
        if w.backlog:
            return w.backlog.popleft()
        try:
            return w.queue.get_nowait() if timeout is None else w.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _coalesce(self, w: _LinkWorker, first: _Item, max_bytes: int) -> list[_Item]:
        """`first` and the consecutive layers of its transfer already waiting behind it.

        NOTE: when the link falls behind the model, the layers that piled up go out as one message (fewer,
        larger messages: the per-message cost dominates otherwise); when the model is the slower one, each
        layer still leaves alone, the moment it is offered. Nothing ever waits for more layers."""
        assert first.state is not None and first.state.descriptor is not None
        batch = [first]
        limit = max(1, max_bytes // first.state.descriptor.layer_nbytes)
        while len(batch) < limit:
            nxt = self._next_item(w, None)
            if nxt is None:
                break
            if nxt.op is not _Op.LAYER or nxt.state is not first.state or nxt.layer != batch[-1].layer + 1:
                w.backlog.appendleft(nxt)
                break
            batch.append(nxt)
        return batch

    def _send_begin(self, link: SendLink, item: _Item) -> None:
        state = item.state
        assert state is not None and state.descriptor is not None
        with state.io_lock:
            if state.status.is_finished:
                return
        payload = bytes_tensor(state.descriptor.to_bytes())
        link.send(Header(MsgKind.BEGIN, state.seq, 0, payload.numel()), payload)

    def _send_abort(self, link: SendLink, item: _Item) -> None:
        state = item.state
        assert state is not None
        # NOTE: names the request too: the BEGIN may never have gone out, leaving the seq unknown there
        raw = bytes_tensor(json.dumps({"request_id": state.request_id, "reason": item.reason}).encode())
        link.send(Header(MsgKind.ABORT, state.seq, 0, raw.numel()), raw)

    def _send_layers(self, link: SendLink, batch: list[_Item]) -> None:
        state = batch[0].state
        assert state is not None
        if time.monotonic() > state.deadline:  # the watchdog may lag (e.g. this process was paused)
            with self._lock:
                if not state.status.is_finished:
                    self._on_expire(state)
            return
        assert state.descriptor is not None
        payload = link.staging(len(batch) * state.descriptor.layer_nbytes)
        with state.io_lock:
            if state.status.is_finished:
                return  # failed meanwhile: its blocks are the worker's again, do not read them
            self._pack(state, batch[0].layer, [item.event for item in batch], payload)
        # NOTE: counted as sent before `send`, which may wait for the link's window: a deadline passing
        # meanwhile must find every layer out (and leave the verdict to the receiver), since this message
        # goes out regardless. An explicit abort (or close) can still land in that wait, and the receiver
        # may then hold every layer and report DONE: whoever aborts tears down both sides (the router does).
        with self._lock:
            if state.status.is_finished:
                return
            state.layers_sent += len(batch)
            with state.io_lock:
                if state.status == TransferStatus.PENDING:
                    state.status = TransferStatus.TRANSFERRING
        link.send(Header(MsgKind.LAYER, state.seq, batch[0].layer, payload.numel()), payload)

    def _pack(self, state: _SendState, first: int, events: list[torch.cuda.Event | None], out: torch.Tensor) -> None:
        """Gather layers [first, first + len(events)) of the transfer's blocks into `out` (flat uint8, on the
        link's payload device), complete when this returns."""
        assert state.src_index is not None and state.descriptor is not None
        shape = (len(events), *state.descriptor.layer_shape)  # [count, 2, n, block_size, heads, head_dim]
        dest = out.view(self.cache.tensor.dtype).view(shape)
        if self._stream is None:
            pack_layers(self.cache.tensor, first, len(events), state.src_index, out=dest)
            return
        with torch.cuda.stream(self._stream):
            for event in events:
                assert event is not None
                self._stream.wait_event(event)
            if dest.device == self.cache.device:
                pack_layers(self.cache.tensor, first, len(events), state.src_index, out=dest)
            else:
                dest.copy_(pack_layers(self.cache.tensor, first, len(events), state.src_index))
            # NOTE: synchronous, so that a failed transfer's blocks are never read after it is reported
            # and the send (on another stream) sees finished data.
            self._stream.synchronize()

    def _run_replies(self, w: _LinkWorker, link: SendLink) -> None:
        try:
            while not w.dead:
                header, payload = link.recv_reply()
                if header.kind == MsgKind.PONG:
                    continue
                if header.kind == MsgKind.BYE:
                    raise LinkError(f"the receiver closed the link: {payload.decode(errors='replace')}"
                                    if payload else "the receiver closed the link")
                if header.kind not in (MsgKind.ACK, MsgKind.NACK):
                    raise LinkError(f"unexpected {header.kind.name} from the receiver")
                with self._lock:
                    state = w.transfers.get(header.seq)
                    if state is None:
                        continue  # already failed here (deadline, abort)
                    if header.kind == MsgKind.ACK:
                        self._finish_locked(state, None)
                    else:
                        self._finish_locked(state, f"receiver {w.dst.endpoint_id!r} refused: "
                                                   f"{payload.decode(errors='replace')}")
        except LinkError as e:
            self._link_failed(w, str(e))
        except Exception as e:
            log.exception("KV sender %s: replies from %s failed", self.endpoint_id, w.dst.endpoint_id)
            self._link_failed(w, f"internal error: {e!r}")
