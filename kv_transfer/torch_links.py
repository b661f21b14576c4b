"""The links of the torch.distributed transport: one sending and one receiving end of a pairwise group.

Framing: every message is one gloo message on TAG_MSG, a frame (the header and where the payload is) and,
when it fits the receiver's slots (`_SLOT_BYTES`), the payload right behind it; a larger payload follows
on TAG_PAYLOAD (or on NCCL). See `TorchRecvLink` for why. The endpoints that open and serve these links are
`kv_transfer.torch_transport`'s.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch

from kv_transfer.config import KVTransferConfig
from kv_transfer.frame_limits import MAX_COALESCED_BYTES, check_reply, clip_reason
from kv_transfer.pair_group import (
    TAG_MSG,
    TAG_PAYLOAD,
    TAG_REPLY,
    PairGroup,
    PendingOp,
)
from kv_transfer.wire import HEADER_LEN, Header, LinkError, RecvLink, SendLink, bytes_tensor

log = logging.getLogger(__name__)

_WINDOW = 4  # messages a sending link holds (handed over, not yet out) before `send` waits
# Framing (part of the wire protocol: change it, bump wire.PROTOCOL_VERSION). A message with a payload
# starts with a frame, its header and where its payload is (`_Where`); a header-only message is the bare
# header, which a peer of another protocol version rejects cleanly. A receiving link keeps _RECV_SLOTS
# receives of _SLOT_BYTES posted (16 MiB per link); a message that fits one travels as one gloo message.
_SLOT_BYTES = 4 << 20
_RECV_SLOTS = 4
_FRAME_BYTES = 8 * (HEADER_LEN + 1)
_MAX_NCCL_MESSAGE = MAX_COALESCED_BYTES  # layers coalesced into one NCCL message stay under this


class _Where(enum.IntEnum):
    """Where a message's payload travels."""

    INLINE = 0  # right behind the frame, in the same gloo message
    SEPARATE = 1  # as a second gloo message on TAG_PAYLOAD (too large for a slot)
    NCCL = 2  # on the pair's NCCL group (CUDA layers between two GPUs)


class _Part(NamedTuple):
    """One piece of a message for the poster: a tensor and the channel that carries it."""

    tensor: torch.Tensor
    tag: int  # the gloo tag; ignored for NCCL
    nccl: bool = False


class _Staging:
    """A grow-only message buffer, reused message after message (never while a message still uses it)."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8, device=self.buf.device)
        return self.buf[:nbytes]


def _frame(header: Header, where: _Where) -> torch.Tensor:
    return torch.cat([header.to_tensor(), torch.tensor([int(where)], dtype=torch.int64)])


class TorchSendLink(SendLink):
    """Streams messages. The sender core packs a layer and hands it to `send`; the link's poster thread
    posts it (one gloo message when it fits a receive slot) and waits for it, while the core packs the next.
    At most `_WINDOW` messages are handed over and not yet out.

    NOTE: gloo writes a message in the thread that posts it when the receiver is ready for it (the receiver
    keeps slots posted, so it usually is). Posted from the packing thread, every layer's write waited for
    its pack and the next pack for the write; with its own poster they overlap (1.25 -> 0.9 ms per layer
    of a 2,048-token SmolLM2 transfer here).
    """

    def __init__(self, group: PairGroup, config: KVTransferConfig, name: str) -> None:
        self._group = group
        self._config = config
        self.payload_device = group.nccl_device or torch.device("cpu")
        # NCCL takes any size at no extra cost; over gloo a message that fits the receiver's slots is best
        self.max_message_bytes = _MAX_NCCL_MESSAGE if group.nccl is not None else _SLOT_BYTES - _FRAME_BYTES
        self._next_reply: PendingOp | None = None
        # NOTE: one more than can be handed over: the buffer handed out next was last used _WINDOW + 1
        # messages ago, and `send` never leaves more than _WINDOW messages unfinished.
        self._ring = [_Staging(self.payload_device) for _ in range(_WINDOW + 1)]
        self._turn = 0
        self._staged: torch.Tensor | None = None  # the whole message buffer behind the last `staging` view
        self._staged_payload: torch.Tensor | None = None  # that view, as handed out
        self._outbox: queue.SimpleQueue[list[_Part] | None] = queue.SimpleQueue()
        self._progress = threading.Condition()
        self._unfinished = 0  # messages handed to the poster and not yet out
        self._error: LinkError | None = None  # why the poster stopped
        self._closing = False
        self._poster = threading.Thread(target=self._post_loop, daemon=True, name=f"kv-post-{name}")
        self._poster.start()

    def staging(self, nbytes: int) -> torch.Tensor:
        self._turn = (self._turn + 1) % len(self._ring)
        if self.payload_device.type == "cuda":
            self._staged = self._staged_payload = None
            return self._ring[self._turn].take(nbytes)
        # room for the frame in front, so the layer goes out as it was packed, in one message
        self._staged = self._ring[self._turn].take(_FRAME_BYTES + nbytes)
        self._staged_payload = self._staged[_FRAME_BYTES:]
        return self._staged_payload

    def send(self, header: Header, payload: torch.Tensor | None) -> None:
        nbytes = 0 if payload is None else payload.numel()
        assert nbytes == header.nbytes, f"header says {header.nbytes} bytes, payload has {nbytes}"
        if payload is None or not nbytes:
            parts = [_Part(header.to_tensor(), TAG_MSG)]
        elif payload.device.type == "cuda":
            parts = [_Part(_frame(header, _Where.NCCL), TAG_MSG), _Part(payload, 0, nccl=True)]
        elif _FRAME_BYTES + nbytes <= _SLOT_BYTES:
            message = self._framed(payload)
            message[:_FRAME_BYTES].view(torch.int64).copy_(_frame(header, _Where.INLINE))
            parts = [_Part(message, TAG_MSG)]
        else:
            parts = [_Part(_frame(header, _Where.SEPARATE), TAG_MSG), _Part(payload, TAG_PAYLOAD)]
        with self._progress:
            self._wait_locked(lambda: self._unfinished < _WINDOW)
            self._unfinished += 1
        self._outbox.put(parts)

    def flush(self) -> None:
        with self._progress:
            self._wait_locked(lambda: self._unfinished == 0)

    def idle(self) -> None:
        # NOTE: the poster sends everything handed to it unprompted; waiting here would only delay the
        # next layer's pack behind the last one's write
        with self._progress:
            self._raise_if_failed_locked()

    def _wait_locked(self, ready: Callable[[], bool]) -> None:
        # NOTE: the poster finishes or fails each message within 2 * op_timeout_s, so this is bounded too
        limit = 2 * self._config.op_timeout_s * (_WINDOW + 1)
        if not self._progress.wait_for(lambda: self._error is not None or ready(), limit):
            raise LinkError(f"messages to the receiver not out after {limit:.3g}s")
        self._raise_if_failed_locked()

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            raise LinkError(str(self._error)) from self._error

    def _post_loop(self) -> None:
        while (parts := self._outbox.get()) is not None and not self._closing:
            try:
                ops = [self._group.isend_nccl(p.tensor) if p.nccl else self._group.isend(p.tensor, p.tag)
                       for p in parts]
                for op in ops:
                    op.wait(self._config.op_timeout_s)
            except Exception as e:  # LinkError, or a bug: either way the link is done, and says why
                if not isinstance(e, LinkError):
                    log.exception("KV send link: posting a message failed")
                with self._progress:
                    self._error = e if isinstance(e, LinkError) else LinkError(f"internal error: {e!r}")
                    self._progress.notify_all()
                return
            with self._progress:
                self._unfinished -= 1
                self._progress.notify_all()

    def _framed(self, payload: torch.Tensor) -> torch.Tensor:
        """`payload` with the frame's room in front: the staging buffer it was packed into, or a copy."""
        if payload is self._staged_payload and self._staged is not None:
            return self._staged
        message = torch.empty(_FRAME_BYTES + payload.numel(), dtype=torch.uint8)
        message[_FRAME_BYTES:].copy_(payload)
        return message

    def recv_reply(self) -> tuple[Header, bytes]:
        # NOTE: reply payloads (NACK reasons) share the reply tag: they are small, and rare
        op = self._next_reply or self._group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
        self._next_reply = None
        op.wait(self._config.liveness_s)
        header = Header.from_tensor(op.tensor)
        check_reply(header, "the receiver")  # before its reason is allocated
        payload = torch.empty(header.nbytes, dtype=torch.uint8)
        if header.nbytes:
            self._group.irecv(payload, TAG_REPLY).wait(self._config.op_timeout_s)
        self._next_reply = self._group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
        return header, payload.numpy().tobytes()

    def close(self) -> None:
        # NOTE: what is still queued is dropped; a message being posted ends within 2 * op_timeout_s, so
        # the poster is never left blocked in gloo when the process exits
        self._closing = True
        self._outbox.put(None)
        self._poster.join(timeout=2 * self._config.op_timeout_s)
        self._next_reply = None  # (a pending receive would keep the connection open)
        self._group.close()


class _Incoming(NamedTuple):
    """One message as it came off the link: its payload arrived inside it (`inline`, in `slot`) or is
    still arriving on its own (`payload`)."""

    header: Header
    inline: torch.Tensor | None = None
    slot: torch.Tensor | None = None  # the receive slot to post again once the message is landed
    payload: PendingOp | None = None


class TorchRecvLink(RecvLink):
    """A receiving link: `recv` the next message, `read_payload` it, `release` it.

    NOTE: a gloo payload moves only once its receive is posted (the sender waits for the receiver's
    "ready"), so a receive posted after its message's header has been read costs a round trip through both
    processes' threads per message. The link therefore keeps `_RECV_SLOTS` receives of `_SLOT_BYTES`
    posted at all times: a message that fits one (a frame, then its payload) lands with no round trip,
    and the next layers arrive while the core scatters this one. Larger payloads, and NCCL's, follow their
    frame as a second message, received the moment the frame is read.
    """

    def __init__(self, group: PairGroup, peer_id: str, config: KVTransferConfig) -> None:
        self.peer_id = peer_id
        self._group = group
        self._config = config
        self._posted: deque[PendingOp] = deque()
        self._big_cpu = _Staging(torch.device("cpu"))
        self._big_gpu = _Staging(group.nccl_device) if group.nccl_device is not None else None
        for _ in range(_RECV_SLOTS):
            self._post(torch.empty(_SLOT_BYTES, dtype=torch.uint8))

    def recv(self, admit: Callable[[Header], None]) -> _Incoming:
        """The next message; a payload that did not come inside it is then being received. `admit(header)`
        raises LinkError for a header the link may not send (checked before any buffer is allocated)."""
        op = self._posted.popleft()
        op.wait(self._config.liveness_s)  # the sender pings at least every keepalive_s
        slot = op.tensor
        frame = slot[:_FRAME_BYTES].view(torch.int64)
        header = Header.from_tensor(frame[:HEADER_LEN])
        admit(header)
        if not header.nbytes:  # a bare header
            self._post(slot)
            return _Incoming(header)
        try:
            where = _Where(int(frame[HEADER_LEN]))
        except ValueError:
            raise LinkError(f"sender {self.peer_id!r} framed a payload as {int(frame[HEADER_LEN])}, which is "
                            f"none of {[w.name for w in _Where]}") from None
        if where is _Where.INLINE:
            if _FRAME_BYTES + header.nbytes > _SLOT_BYTES:
                raise LinkError(f"sender {self.peer_id!r} sent {header.nbytes} bytes inline; a slot holds "
                                f"{_SLOT_BYTES - _FRAME_BYTES}")
            return _Incoming(header, inline=slot[_FRAME_BYTES:_FRAME_BYTES + header.nbytes], slot=slot)
        self._post(slot)  # the frame is all it held
        if where is _Where.NCCL:
            if self._big_gpu is None:
                raise LinkError(f"sender {self.peer_id!r} sent a payload over NCCL on a link without NCCL")
            return _Incoming(header, payload=self._group.irecv_nccl(self._big_gpu.take(header.nbytes)))
        return _Incoming(header, payload=self._group.irecv(self._big_cpu.take(header.nbytes), TAG_PAYLOAD))

    def read_payload(self, incoming: _Incoming) -> torch.Tensor:
        """The message's payload, flat uint8, once it has fully arrived (valid until `release`)."""
        if incoming.inline is not None:
            return incoming.inline
        assert incoming.payload is not None, "read_payload without a payload"
        incoming.payload.wait(self._config.op_timeout_s)
        return incoming.payload.tensor

    def release(self, incoming: _Incoming) -> None:
        """The message is landed (its payload read): its slot takes the next messages again."""
        if incoming.slot is not None:
            self._post(incoming.slot)

    def send_reply(self, header: Header, payload: bytes) -> None:
        payload = clip_reason(payload)
        ops = [self._group.isend(header._replace(nbytes=len(payload)).to_tensor(), TAG_REPLY)]
        if payload:
            ops.append(self._group.isend(bytes_tensor(payload), TAG_REPLY))
        for op in ops:
            op.wait(self._config.op_timeout_s)

    def close(self) -> None:
        self._posted.clear()  # (a pending receive would keep the connection open)
        self._group.close()

    def _post(self, slot: torch.Tensor) -> None:
        self._posted.append(self._group.irecv(slot, TAG_MSG))
