"""The sender core, shared by every transport: layer-wise push over one link per receiver.

`begin` registers a transfer and queues its descriptor; `send_layer` (called by the model right after a
layer's KV is written) queues that layer and returns. Per receiver, one link thread connects, then drains
the queue in order: it packs each layer's source blocks into one buffer (`index_select`) and hands it to
the link, so the transfer runs while the model computes the next layers (consecutive layers that are
already waiting go out together, up to the link's message size, see `kv_transfer.send_link`); a second
thread reads the receiver's replies (ACK finishes a transfer, NACK fails it). Many transfers share the link,
told apart by their `seq`. The receiver decides whether a transfer landed: see `_on_expire`.

A transport subclass only says how to open a link (`_connect`); everything about transfers lives here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache
from kv_transfer.base import KVSender, TransferStatus
from kv_transfer.book import BookKeeper, TransferBook
from kv_transfer.config import KVTransferConfig
from kv_transfer.layout import TransferDescriptor
from kv_transfer.send_link import LinkWorker, SendItem, SendOp, SendState, pack_batch
from kv_transfer.wire import Header, LinkError, MsgKind, SendLink, bytes_tensor
from protocol.messages import PeerAddress

log = logging.getLogger(__name__)


class LayerwiseSender(BookKeeper, KVSender):
    """Transport-independent `KVSender`; subclasses implement `_connect`."""

    transport: str  # which PeerAddress.transport this sender can reach

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig) -> None:
        if not endpoint_id:
            raise ValueError("endpoint_id must name this sender")
        self.endpoint_id = endpoint_id
        self.cache = cache
        self.config = config
        self._book: TransferBook[SendState] = TransferBook(f"kv-send-{endpoint_id}", self._on_expire)
        self._lock = self._book.lock
        self._links: dict[tuple[str, str], LinkWorker] = {}  # (endpoint_id, incarnation) -> link
        self._workers: list[LinkWorker] = []  # every link whose thread may still run, broken ones too
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
        state = SendState(request_id, dst.endpoint_id, src, deadline)
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
            link.queue.put(SendItem(SendOp.BEGIN, state))

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
            state.link.queue.put(SendItem(SendOp.LAYER, state, layer, event))

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
                link.queue.put(SendItem(SendOp.STOP))
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

    def _finish_locked(self, state: SendState, error: str | None) -> bool:
        if not self._book.finish_locked(state, error):
            return False
        if state.link is not None:
            state.link.transfers.pop(state.seq, None)
        return True

    def _fail_locked(self, state: SendState, reason: str, tell_peer: bool) -> None:
        if self._finish_locked(state, reason) and tell_peer and state.link is not None and not state.link.dead:
            state.link.queue.put(SendItem(SendOp.ABORT, state, reason=reason))

    def _on_expire(self, state: SendState) -> None:
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

    def _link_for_locked(self, dst: PeerAddress) -> LinkWorker:
        key = (dst.endpoint_id, dst.incarnation)
        link = self._links.get(key)
        if link is None or link.dead:
            link = LinkWorker(dst)
            self._links[key] = link
            link.thread = threading.Thread(target=self._run_link, args=(link,), daemon=True,
                                           name=f"kv-send-{self.endpoint_id}->{dst.endpoint_id}")
            link.thread.start()
            self._workers = [w for w in self._workers if w.thread is not None and w.thread.is_alive()] + [link]
        return link

    def _link_failed(self, w: LinkWorker, reason: str) -> None:
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
            w.queue.put(SendItem(SendOp.WAKE))

    # ---- the link's threads ----

    def _run_link(self, w: LinkWorker) -> None:
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

    def _send_loop(self, w: LinkWorker, link: SendLink) -> None:
        next_ping = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_ping:  # NOTE: also while busy, so the receiver's replies never go quiet
                link.send(Header(MsgKind.PING), None)
                next_ping = now + self.config.keepalive_s
            if not w.backlog and w.queue.empty():
                link.idle()  # going idle: let batched messages go (and surface a broken link now)
            item = w.next_item(max(0.0, next_ping - time.monotonic()))
            if item is None:
                continue
            if w.dead:
                return
            if item.op is SendOp.STOP:
                link.send(Header(MsgKind.BYE), None)
                link.flush()
                return
            if item.op is SendOp.BEGIN:
                self._send_begin(link, item)
            elif item.op is SendOp.ABORT:
                self._send_abort(link, item)
            elif item.op is SendOp.LAYER:
                self._send_layers(link, w.coalesce(item, link.max_message_bytes))

    def _send_begin(self, link: SendLink, item: SendItem) -> None:
        state = item.state
        assert state is not None and state.descriptor is not None
        with state.io_lock:
            if state.status.is_finished:
                return
        payload = bytes_tensor(state.descriptor.to_bytes())
        link.send(Header(MsgKind.BEGIN, state.seq, 0, payload.numel()), payload)

    def _send_abort(self, link: SendLink, item: SendItem) -> None:
        state = item.state
        assert state is not None
        # NOTE: names the request too: the BEGIN may never have gone out, leaving the seq unknown there
        raw = bytes_tensor(json.dumps({"request_id": state.request_id, "reason": item.reason}).encode())
        link.send(Header(MsgKind.ABORT, state.seq, 0, raw.numel()), raw)

    def _send_layers(self, link: SendLink, batch: list[SendItem]) -> None:
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
            pack_batch(self.cache, self._stream, state, batch[0].layer, [item.event for item in batch],
                       payload)
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

    def _run_replies(self, w: LinkWorker, link: SendLink) -> None:
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
