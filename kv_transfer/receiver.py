"""The receiver core, shared by every transport: dispatch incoming messages, scatter layers into place.

A transport reads messages off its links and hands each to `handle`; the core matches BEGIN to a transfer
the decode worker announced with `expect` (checking the layout and the block ids against its own cache),
scatters each LAYER message (one layer, or a few consecutive ones) straight into the reserved,
non-contiguous destination blocks, and finishes the transfer when every layer has landed. Replies (PONG,
ACK, NACK) are queued per link and sent by the link's own thread (`take_replies`), so only that thread
ever writes to a link.

Before any payload is read (or a buffer for it allocated), `admit` checks its header against what the link
may send (see `frame_limits`): a LAYER only for a transfer begun on this link, of whole layers of it. A
transfer that ended here (failed, refused, aborted) is remembered per link (`_retired`), so its sender's
layers still in flight are drained and dropped instead of breaking the link.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from kv_transfer.base import KVReceiver, TransferStatus
from kv_transfer.book import BookKeeper, TransferBook, TransferState
from kv_transfer.config import KVTransferConfig
from kv_transfer.frame_limits import (
    MAX_ABORT_BYTES,
    check_bare,
    check_layer,
    clip_reason,
    max_descriptor_bytes,
)
from kv_transfer.layout import LayoutMismatch, TransferDescriptor, from_bytes, scatter_layers
from kv_transfer.wire import Header, LinkError, MsgKind, RecvLink

_MAX_ENDED = 4096
_MAX_RETIRED = 1024  # per link: ended transfers whose late layers are still drained (far more than in flight)


@dataclass(eq=False)
class _RecvState(TransferState):
    dst_index: torch.Tensor | None = None  # [num_blocks] int64 on the cache's device
    link: RecvLink | None = None  # bound by the sender's BEGIN
    seq: int = -1
    descriptor: TransferDescriptor | None = None
    landed: set[int] = field(default_factory=set)


class LayerwiseReceiver(BookKeeper, KVReceiver):
    """Transport-independent `KVReceiver`; subclasses run the links and call `handle`."""

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig) -> None:
        if not endpoint_id:
            raise ValueError("endpoint_id must name this receiver")
        self.endpoint_id = endpoint_id
        self.cache = cache
        self.config = config
        self._book: TransferBook[_RecvState] = TransferBook(f"kv-recv-{endpoint_id}", self._on_expire)
        self._lock = self._book.lock
        self._bound: dict[RecvLink, dict[int, _RecvState]] = {}  # link -> seq -> transfer
        # link -> seq -> descriptor of a transfer begun on it that ended here: its late layers are dropped
        self._retired: dict[RecvLink, OrderedDict[int, TransferDescriptor]] = {}
        self._max_descriptor_bytes = max_descriptor_bytes(cache.num_blocks)
        self._max_layer_nbytes = cache.tensor[0].numel() * cache.tensor.element_size()  # one layer, every block
        self._replies: dict[RecvLink, list[tuple[Header, bytes]]] = {}
        # why recent transfers failed before their sender began, so a late BEGIN is refused with the reason
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._closed = False
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None

    # ---- the worker's API ----

    def expect(self, request_id: str, src: str, dst_block_ids: Sequence[int], deadline: float) -> None:
        ids = tuple(int(b) for b in dst_block_ids)
        bad = [b for b in ids if not 0 <= b < self.cache.num_blocks]
        if bad:
            raise ValueError(f"dst_block_ids {bad} outside the cache's {self.cache.num_blocks} blocks")
        if len(set(ids)) != len(ids):
            raise ValueError(f"dst_block_ids of {request_id!r} repeat a block: {ids}")
        state = _RecvState(request_id, src, ids, deadline)
        state.dst_index = torch.tensor(ids, dtype=torch.int64, device=self.cache.device)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KV receiver {self.endpoint_id!r} is closed")
            self._book.add_locked(state)
            if not ids:  # everything was in the prefix cache
                self._book.finish_locked(state, None)

    def abort(self, request_id: str, reason: str = "aborted by the receiver") -> None:
        self._abort(request_id, reason)

    def _close_transfers(self) -> bool:
        """Fail everything in flight; False if already closed. Subclasses' `close` starts with this."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            for state in self._book.active_locked():
                self._fail_locked(state, f"transfer {state.request_id!r}: receiver closed", tell_peer=True)
        return True

    # ---- called by the transport's link threads ----

    def admit(self, link: RecvLink, header: Header) -> None:
        """Raise LinkError unless `header` is a message `link` may send now, its `nbytes` within what that
        message can carry. A transport calls this before it allocates anything for the payload."""
        sender = f"sender {link.peer_id!r}"
        kind = header.kind
        if kind in (MsgKind.PING, MsgKind.BYE):
            check_bare(header, 0, sender)
        elif kind == MsgKind.BEGIN:
            check_bare(header, self._max_descriptor_bytes, sender)
        elif kind == MsgKind.ABORT:
            check_bare(header, MAX_ABORT_BYTES, sender)
        elif kind == MsgKind.LAYER:
            with self._lock:
                state = self._bound.get(link, {}).get(header.seq)
                desc = state.descriptor if state is not None else self._retired.get(link, {}).get(header.seq)
            if desc is None:
                raise LinkError(f"{sender} sent a LAYER ({header.nbytes} bytes) for transfer seq {header.seq}, "
                                "which it never began on this link")
            check_layer(header, desc, sender)
        else:
            raise LinkError(f"unexpected {kind.name} from {sender}")

    def handle(self, link: RecvLink, header: Header, read_payload: Callable[[], torch.Tensor]) -> None:
        """Dispatch one message from `link` (checked by `admit` first). `read_payload()` returns its payload
        as flat uint8 (valid until the link's next message) and may be called once; the transport discards a
        payload left unread. Raises LinkError when the link is broken or the sender broke the protocol."""
        self.admit(link, header)
        kind = header.kind
        if kind == MsgKind.PING:
            with self._lock:
                self._reply_locked(link, Header(MsgKind.PONG), b"")
        elif kind == MsgKind.BEGIN:
            self._on_begin(link, header.seq, read_payload().cpu().numpy().tobytes())
        elif kind == MsgKind.LAYER:
            self._on_layer(link, header, read_payload)
        elif kind == MsgKind.ABORT:
            try:
                abort = json.loads(read_payload().cpu().numpy().tobytes())
                request_id, reason = str(abort["request_id"]), str(abort["reason"])
            except (ValueError, KeyError, TypeError) as e:
                raise LinkError(f"malformed ABORT from sender {link.peer_id!r}") from e
            with self._lock:
                state = self._bound.get(link, {}).get(header.seq)
                if state is None:  # aborted before its BEGIN went out
                    state = self._book.get_locked(request_id)
                    if state is None or state.link is not None or state.peer_id != link.peer_id:
                        return
                self._fail_locked(state, f"the sender gave up: {reason}", tell_peer=False)

    def take_replies(self, link: RecvLink) -> list[tuple[Header, bytes]]:
        with self._lock:
            return self._replies.pop(link, [])

    def link_failed(self, link: RecvLink, reason: str) -> None:
        """The link is gone: fail its transfers (their blocks may hold partial KV)."""
        with self._lock:
            for state in list(self._bound.pop(link, {}).values()):
                self._finish_locked(state, f"transfer {state.request_id!r}: link from sender "
                                           f"{link.peer_id!r} broke: {reason}")
            self._replies.pop(link, None)
            self._retired.pop(link, None)

    # ---- messages ----

    def _on_begin(self, link: RecvLink, seq: int, raw: bytes) -> None:
        with self._lock:
            try:
                desc = TransferDescriptor.from_bytes(raw)
            except ValueError as e:
                self._reply_locked(link, Header(MsgKind.NACK, seq), str(e).encode())
                return
            state = self._book.get_locked(desc.request_id)
            refusal = None
            if state is None and desc.request_id in self._ended:
                refusal = self._ended.pop(desc.request_id)
            elif state is None:
                refusal = (f"receiver {self.endpoint_id!r} expects no transfer {desc.request_id!r} (expect() "
                           "must come before the sender's begin, and a finished one cannot restart)")
            elif state.peer_id != link.peer_id:
                refusal = f"transfer {desc.request_id!r} is expected from {state.peer_id!r}, not {link.peer_id!r}"
            elif state.link is not None:
                refusal = f"transfer {desc.request_id!r} was already begun"
            if refusal is not None:
                self._reply_locked(link, Header(MsgKind.NACK, seq), refusal.encode())
                self._retire_locked(link, seq, desc)
                return
            assert state is not None
            state.link, state.seq = link, seq
            try:
                desc.check_fits(self.cache.spec, state.block_ids)
            except LayoutMismatch as e:
                self._fail_locked(state, f"transfer {desc.request_id!r} refused: {e}", tell_peer=True)
                self._retire_locked(link, seq, desc)
                return
            state.descriptor = desc
            self._bound.setdefault(link, {})[seq] = state

    def _on_layer(self, link: RecvLink, header: Header, read_payload: Callable[[], torch.Tensor]) -> None:
        """Layers [header.layer, header.layer + count) of one transfer; count = nbytes / layer_nbytes."""
        with self._lock:
            state = self._bound.get(link, {}).get(header.seq)
            if state is None:
                return  # ended here already (failed or aborted): drop the bytes
            desc = state.descriptor
            assert desc is not None and state.dst_index is not None  # (and `admit` checked the size)
        packed = from_bytes(read_payload(), desc)  # [count, 2, n, block_size, num_kv_heads, head_dim]
        layers = range(header.layer, header.layer + packed.shape[0])
        if time.monotonic() > state.deadline:
            # NOTE: a layer arriving late never lands, even if the watchdog has not run yet (e.g. this
            # process was paused): the sender already gave up on its own deadline.
            with self._lock:
                if not state.status.is_finished:
                    self._on_expire(state)
            return
        with state.io_lock:
            if state.status.is_finished:
                return  # failed while the bytes were in flight: its blocks are the worker's again
            duplicate = not state.landed.isdisjoint(layers)
            if not duplicate:
                self._scatter(state.dst_index, header.layer, packed)
                state.landed.update(layers)
                if state.status == TransferStatus.PENDING:
                    state.status = TransferStatus.TRANSFERRING
            complete = len(state.landed) == desc.layer_stop - desc.layer_start
        if duplicate or complete:
            with self._lock:
                if duplicate:
                    self._fail_locked(state, f"transfer {state.request_id!r}: layers {list(layers)} arrived "
                                             "twice", tell_peer=True)
                elif self._finish_locked(state, None):
                    self._reply_locked(link, Header(MsgKind.ACK, state.seq), b"")

    def _scatter(self, dst_index: torch.Tensor, first: int, packed: torch.Tensor) -> None:
        if self._stream is None:
            scatter_layers(self.cache.tensor, first, dst_index, packed)
            return
        with torch.cuda.stream(self._stream):
            scatter_layers(self.cache.tensor, first, dst_index, packed.to(self.cache.device, non_blocking=True))
        # NOTE: synchronous, so that DONE means visible to every stream, nothing is written after a
        # transfer is reported finished, and the link may reuse its receive buffer at once.
        self._stream.synchronize()

    # ---- state changes (caller holds self._lock) ----

    def _finish_locked(self, state: _RecvState, error: str | None) -> bool:
        if not self._book.finish_locked(state, error):
            return False
        if state.link is not None:
            self._bound.get(state.link, {}).pop(state.seq, None)
            if state.descriptor is not None:
                self._retire_locked(state.link, state.seq, state.descriptor)
        elif error is not None:
            self._ended[state.request_id] = error
            while len(self._ended) > _MAX_ENDED:
                self._ended.popitem(last=False)
        return True

    def _fail_locked(self, state: _RecvState, reason: str, tell_peer: bool) -> None:
        if self._finish_locked(state, reason) and tell_peer and state.link is not None:
            self._reply_locked(state.link, Header(MsgKind.NACK, state.seq), reason.encode())

    def _reply_locked(self, link: RecvLink, header: Header, payload: bytes) -> None:
        payload = clip_reason(payload)
        self._replies.setdefault(link, []).append((header._replace(nbytes=len(payload)), payload))

    def _retire_locked(self, link: RecvLink, seq: int, desc: TransferDescriptor) -> None:
        """Remember a transfer begun on `link` that ended here, so its late layers are dropped, not taken
        for a protocol violation. Only if one of its layers is no larger than one of this whole cache: a
        refused descriptor may claim any size, and a payload is received (allocated) before it is dropped."""
        if desc.layer_nbytes > self._max_layer_nbytes:
            return
        retired = self._retired.setdefault(link, OrderedDict())
        retired[seq] = desc
        while len(retired) > _MAX_RETIRED:
            retired.popitem(last=False)

    def _on_expire(self, state: _RecvState) -> None:
        if state.descriptor is None:
            progress = "before the sender began"
        else:
            progress = f"with {len(state.landed)}/{state.descriptor.layer_stop - state.descriptor.layer_start} " \
                       "layers landed"
        self._fail_locked(state, f"transfer {state.request_id!r} from {state.peer_id!r}: deadline passed "
                                 f"{progress}", tell_peer=True)
