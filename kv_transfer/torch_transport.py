"""The torch.distributed transport: a pairwise group per (sender, receiver), made on demand.

Sender side: the first `begin` towards a receiver opens a link (see `rendezvous`), which then carries every
later transfer to that receiver until it breaks; a broken link fails its transfers and the next `begin`
opens a fresh one. Receiver side: a listener thread pops link requests off the receiver's accept queue and
serves each link on its own thread: take the next message (waiting at most `liveness_s`; the sender
pings), hand it to the core, send the replies the core queued. If the store goes away, existing links
carry on and the listener retries with backoff.

Framing: every message is one gloo message on TAG_MSG, a frame (the header and where the payload is) and,
when it fits the receiver's slots (`_SLOT_BYTES`), the payload right behind it; a larger payload follows
on TAG_PAYLOAD (or on NCCL). See `TorchRecvLink` for why.

What a worker needs: the rendezvous store's address (in the config), its own endpoint id, and its node IP
(`host`), which gloo binds to and advertises to the peer.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import logging
import queue
import threading
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.distributed import DistStoreError

from engine.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig
from kv_transfer.frame_limits import MAX_COALESCED_BYTES, check_reply, clip_reason
from kv_transfer.pair_group import (
    RECEIVER_RANK,
    SENDER_RANK,
    TAG_MSG,
    TAG_PAYLOAD,
    TAG_REPLY,
    PairGroup,
    PendingOp,
)
from kv_transfer.receiver import LayerwiseReceiver
from kv_transfer.rendezvous import (
    LinkRequest,
    accept_queue_key,
    connect_store,
    device_tag,
    link_prefix,
    use_nccl,
)
from kv_transfer.sender import LayerwiseSender
from kv_transfer.wire import HEADER_LEN, Header, LinkError, MsgKind, RecvLink, SendLink, bytes_tensor
from protocol.messages import PeerAddress

log = logging.getLogger(__name__)

_LISTEN_TIMEOUT_S = 3600.0  # a listener's blocking pop; close() wakes it with a sentinel instead
_MAX_SEEN_LINKS = 100_000  # link ids remembered against replays (far more than open within MAX_REQUEST_AGE_S)
_CLOSE = "close"
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


def _close_at_exit(endpoint: TorchKVSender | TorchKVReceiver) -> None:
    """Close the endpoint when the process exits, if nobody did.

    NOTE: a link or listener thread still blocked in gloo or the store while the interpreter finalizes
    aborts the process ("terminate called without an active exception"). Weak, so the registration does
    not keep the endpoint alive."""
    ref = weakref.ref(endpoint)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)


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


class TorchKVSender(LayerwiseSender):
    """`KVSender` over pairwise gloo/NCCL groups. `host`: this worker's node IP."""

    transport = "torch"

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig, host: str) -> None:
        if config.kv_transport != "torch":
            raise ValueError(f"KVTransferConfig.kv_transport is {config.kv_transport!r}, not 'torch'")
        super().__init__(endpoint_id, cache, config)
        self.host = host
        self._device = device_tag(cache.device)
        _close_at_exit(self)

    def _connect(self, dst: PeerAddress) -> SendLink:
        cfg = self.config
        assert cfg.rendezvous_host is not None and cfg.rendezvous_port is not None
        store = connect_store(cfg.rendezvous_host, cfg.rendezvous_port, cfg.connect_timeout_s)
        queue = accept_queue_key(cfg.namespace, dst.endpoint_id, dst.incarnation)
        request = LinkRequest.signed(self.endpoint_id, uuid.uuid4().hex, self._device, queue, cfg.secret)
        store.queue_push(queue, request.to_json())
        nccl = self.cache.device if use_nccl(self._device, dst.device) else None
        group = PairGroup(store, link_prefix(cfg.namespace, request.link_id), SENDER_RANK, self.host,
                          cfg.connect_timeout_s, nccl)
        return TorchSendLink(group, cfg, f"{self.endpoint_id}->{dst.endpoint_id}")


class TorchKVReceiver(LayerwiseReceiver):
    """`KVReceiver` over pairwise gloo/NCCL groups. `host`: this worker's node IP."""

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig, host: str) -> None:
        if config.kv_transport != "torch":
            raise ValueError(f"KVTransferConfig.kv_transport is {config.kv_transport!r}, not 'torch'")
        super().__init__(endpoint_id, cache, config)
        self.host = host
        self._address = PeerAddress("torch", endpoint_id, uuid.uuid4().hex[:12], device_tag(cache.device))
        assert config.rendezvous_host is not None and config.rendezvous_port is not None
        self._queue = accept_queue_key(config.namespace, endpoint_id, self._address.incarnation)
        self._seen_links: OrderedDict[str, None] = OrderedDict()  # link ids accepted lately (replays)
        self._listen_store = connect_store(config.rendezvous_host, config.rendezvous_port, _LISTEN_TIMEOUT_S)
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()  # wakes a listener backing off from a store outage
        self._listener = threading.Thread(target=self._listen, daemon=True, name=f"kv-accept-{endpoint_id}")
        self._listener.start()
        _close_at_exit(self)

    @property
    def address(self) -> PeerAddress:
        return self._address

    def close(self) -> None:
        if not self._close_transfers():
            return
        self._stop.set()
        cfg = self.config
        assert cfg.rendezvous_host is not None and cfg.rendezvous_port is not None
        try:
            connect_store(cfg.rendezvous_host, cfg.rendezvous_port, cfg.op_timeout_s).queue_push(self._queue, _CLOSE)
        except RuntimeError as e:  # the store is gone; the daemon listener dies with the process
            log.warning("KV receiver %s: cannot wake its listener: %s", self.endpoint_id, e)
        self._listener.join(timeout=cfg.op_timeout_s)
        # each link notices `_closed` after its next message (a ping at the latest) and says BYE
        for t in list(self._threads):
            t.join(timeout=cfg.liveness_s)
        self._book.close()

    def _listen(self) -> None:
        cfg, backoff = self.config, 0.5
        assert cfg.rendezvous_host is not None and cfg.rendezvous_port is not None
        while not self._closed:
            try:
                raw = self._listen_store.queue_pop(self._queue)
            except DistStoreError:
                continue  # nobody asked for an hour
            except RuntimeError as e:  # the store went away: existing links go on; retry for new ones
                log.warning("KV receiver %s: rendezvous store unreachable (%s); retrying in %.1fs",
                            self.endpoint_id, e, backoff)
                if self._stop.wait(backoff):
                    return
                backoff = min(2 * backoff, 30.0)
                with contextlib.suppress(RuntimeError):  # still down: the next pop fails and we back off
                    self._listen_store = connect_store(cfg.rendezvous_host, cfg.rendezvous_port, _LISTEN_TIMEOUT_S)
                continue
            backoff = 0.5
            if raw == _CLOSE.encode():
                if self._closed:
                    return
                # NOTE: only our own close() may stop the listener; a stray sentinel from anyone else is noise.
                log.warning("KV receiver %s: dropped a close request it did not send", self.endpoint_id)
                continue
            try:
                request = LinkRequest.from_json(raw)
                request.verify(self._queue, cfg.secret)
                if request.link_id in self._seen_links:
                    raise ValueError(f"link id {request.link_id} was used before: a replay")
            except ValueError as e:
                # NOTE: one bad entry must not take the listener (and every future link) down with it.
                log.warning("KV receiver %s: dropped a malformed or unauthenticated link request: %s",
                            self.endpoint_id, e)
                continue
            self._seen_links[request.link_id] = None
            while len(self._seen_links) > _MAX_SEEN_LINKS:  # older ones are past MAX_REQUEST_AGE_S anyway
                self._seen_links.popitem(last=False)
            t = threading.Thread(target=self._serve, args=(request,), daemon=True,
                                 name=f"kv-recv-{self.endpoint_id}<-link")
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, request: LinkRequest) -> None:
        """Run one link: read each message, land it through the core, send the core's replies."""
        cfg = self.config
        assert cfg.rendezvous_host is not None and cfg.rendezvous_port is not None
        try:
            store = connect_store(cfg.rendezvous_host, cfg.rendezvous_port, cfg.connect_timeout_s)
            nccl = self.cache.device if use_nccl(request.device, self._address.device) else None
            group = PairGroup(store, link_prefix(cfg.namespace, request.link_id), RECEIVER_RANK, self.host,
                              cfg.connect_timeout_s, nccl)
        except (LinkError, RuntimeError) as e:
            log.warning("KV receiver %s: link from %s not formed: %s", self.endpoint_id, request.sender, e)
            return
        try:
            link = TorchRecvLink(group, request.sender, cfg)
        except LinkError as e:
            group.close()
            log.warning("KV receiver %s: link from %s broke at once: %s", self.endpoint_id, request.sender, e)
            return
        first, orderly = True, False
        try:
            while True:
                incoming = link.recv(functools.partial(self.admit, link))
                if first:  # both sides have formed the group: its rendezvous keys have served
                    group.forget_rendezvous()
                    first = False
                self._handle(link, incoming)
                if incoming.header.kind == MsgKind.BYE or self._closed:
                    orderly = True
                    link.send_reply(Header(MsgKind.BYE), b"")
                    raise LinkError("the sender closed the link" if incoming.header.kind == MsgKind.BYE
                                    else "the receiver closed")
        except LinkError as e:
            self.link_failed(link, str(e))
            if not orderly:  # e.g. a sender speaking another protocol: say why, on both sides
                log.warning("KV receiver %s: link from %s broke: %s", self.endpoint_id, request.sender, e)
                with contextlib.suppress(LinkError):
                    link.send_reply(Header(MsgKind.BYE), f"receiver {self.endpoint_id!r}: {e}".encode())
        except Exception as e:  # a bug or an allocation failure must not leave transfers waiting
            log.exception("KV receiver %s: link from %s failed", self.endpoint_id, request.sender)
            self.link_failed(link, f"internal error: {e!r}")
        finally:
            link.close()

    def _handle(self, link: TorchRecvLink, incoming: _Incoming) -> None:
        """One message through the core, then its buffer back to the link and the core's replies out."""
        unread = incoming.header.nbytes > 0

        def read_once() -> torch.Tensor:
            nonlocal unread
            assert unread, "a payload is read at most once"
            unread = False
            return link.read_payload(incoming)

        if incoming.header.kind != MsgKind.BYE:
            self.handle(link, incoming.header, read_once)
        if unread:
            link.read_payload(incoming)  # dropped, but gloo must be done writing into the buffer
        link.release(incoming)
        for reply, payload in self.take_replies(link):
            link.send_reply(reply, payload)
