"""The torch.distributed transport: a pairwise group per (sender, receiver), made on demand.

Sender side: the first `begin` towards a receiver opens a link (see `rendezvous`), which then carries every
later transfer to that receiver until it breaks; a broken link fails its transfers and the next `begin`
opens a fresh one. Receiver side: a listener thread pops link requests off the receiver's accept queue and
serves each link on its own thread: read a header (waiting at most `liveness_s`; the sender pings), read
its payload, hand both to the core, send the replies the core queued. If the store goes away, existing
links carry on and the listener retries with backoff.

What a worker needs: the rendezvous store's address (in the config), its own endpoint id, and its node IP
(`host`), which gloo binds to and advertises to the peer.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import uuid
import weakref
from collections import deque

import torch
from torch.distributed import DistStoreError

from engine.kv_cache import KVCache
from kv_transfer.base import PeerAddress
from kv_transfer.config import KVTransferConfig
from kv_transfer.pair_group import (
    RECEIVER_RANK,
    SENDER_RANK,
    TAG_HEADER,
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

log = logging.getLogger(__name__)

_LISTEN_TIMEOUT_S = 3600.0  # a listener's blocking pop; close() wakes it with a sentinel instead
_CLOSE = "close"
_WINDOW = 4  # messages a sending link keeps in flight before it waits for the oldest


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
    """A grow-only receive buffer, reused message after message (the core is done with it by then)."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8, device=self.buf.device)
        return self.buf[:nbytes]


class TorchSendLink(SendLink):
    """Streams messages: each is posted (header, then payload, back to back) and the link waits only for the
    oldest once `_WINDOW` are in flight, or for all of them in `flush`, so packing the next layer overlaps
    the transfer of the previous ones."""

    def __init__(self, group: PairGroup, config: KVTransferConfig) -> None:
        self._group = group
        self._config = config
        self.payload_device = group.nccl_device or torch.device("cpu")
        self._inflight: deque[list[PendingOp]] = deque()
        self._next_reply: PendingOp | None = None
        # NOTE: one more than can be in flight: the buffer handed out next was last used _WINDOW + 1 layer
        # messages ago, and `send` never leaves more than _WINDOW messages in flight.
        self._ring = [_Staging(self.payload_device) for _ in range(_WINDOW + 1)]
        self._turn = 0

    def staging(self, nbytes: int) -> torch.Tensor:
        self._turn = (self._turn + 1) % len(self._ring)
        return self._ring[self._turn].take(nbytes)

    def send(self, header: Header, payload: torch.Tensor | None) -> None:
        ops = [self._group.isend(header.to_tensor(), TAG_HEADER)]
        if payload is not None and payload.numel():
            if header.kind == MsgKind.LAYER and self._group.nccl is not None:
                ops.append(self._group.isend_nccl(payload))
            else:
                ops.append(self._group.isend(payload, TAG_PAYLOAD))
        self._inflight.append(ops)
        while len(self._inflight) > _WINDOW:
            self._complete_oldest()

    def flush(self) -> None:
        while self._inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        for op in self._inflight.popleft():
            op.wait(self._config.op_timeout_s)

    def recv_reply(self) -> tuple[Header, bytes]:
        # NOTE: reply payloads (NACK reasons) share the reply tag: they are small, and rare
        op = self._next_reply or self._group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
        self._next_reply = None
        op.wait(self._config.liveness_s)
        header = Header.from_tensor(op.tensor)
        payload = torch.empty(header.nbytes, dtype=torch.uint8)
        if header.nbytes:
            self._group.irecv(payload, TAG_REPLY).wait(self._config.op_timeout_s)
        self._next_reply = self._group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_REPLY)
        return header, payload.numpy().tobytes()

    def close(self) -> None:
        self._group.close()


class TorchRecvLink(RecvLink):
    """Reads messages in order, always with receives posted ahead of the data.

    NOTE: gloo is several times slower, in CPU and in time, when a message arrives before its receive is
    posted. So a header receive is always posted, and the moment a header lands the link posts its payload's
    receive and the next header's, before anything else runs.
    """

    def __init__(self, group: PairGroup, peer_id: str, config: KVTransferConfig) -> None:
        self.peer_id = peer_id
        self._group = group
        self._config = config
        self._cpu = _Staging(torch.device("cpu"))
        self._gpu = _Staging(group.nccl_device) if group.nccl_device is not None else None
        self._next_header = self._post_header()
        self._payload: PendingOp | None = None

    def recv_header(self) -> Header:
        """The next header; its payload (if any) is then already being received, for `read_payload`."""
        assert self._payload is None, "the previous payload must be read first"
        op = self._next_header
        op.wait(self._config.liveness_s)  # the sender pings at least every keepalive_s
        header = Header.from_tensor(op.tensor)
        if header.nbytes:
            if header.kind == MsgKind.LAYER and self._gpu is not None:
                self._payload = self._group.irecv_nccl(self._gpu.take(header.nbytes))
            else:
                self._payload = self._group.irecv(self._cpu.take(header.nbytes), TAG_PAYLOAD)
        self._next_header = self._post_header()
        return header

    def read_payload(self, header: Header) -> torch.Tensor:
        """The payload of the header just read (flat uint8, valid until the next `recv_header`)."""
        op, self._payload = self._payload, None
        assert op is not None and op.tensor.numel() == header.nbytes, "read_payload without a payload"
        op.wait(self._config.op_timeout_s)
        return op.tensor

    def send_reply(self, header: Header, payload: bytes) -> None:
        ops = [self._group.isend(header.to_tensor(), TAG_REPLY)]
        if payload:
            ops.append(self._group.isend(bytes_tensor(payload), TAG_REPLY))
        for op in ops:
            op.wait(self._config.op_timeout_s)

    def close(self) -> None:
        self._group.close()

    def _post_header(self) -> PendingOp:
        return self._group.irecv(torch.empty(HEADER_LEN, dtype=torch.int64), TAG_HEADER)


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
        request = LinkRequest(self.endpoint_id, uuid.uuid4().hex, self._device)
        store.queue_push(accept_queue_key(cfg.namespace, dst.endpoint_id, dst.incarnation), request.to_json())
        nccl = self.cache.device if use_nccl(self._device, dst.device) else None
        group = PairGroup(store, link_prefix(cfg.namespace, request.link_id), SENDER_RANK, self.host,
                          cfg.connect_timeout_s, nccl)
        return TorchSendLink(group, cfg)


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
            if raw.decode() == _CLOSE:
                return
            t = threading.Thread(target=self._serve, args=(LinkRequest.from_json(raw),), daemon=True,
                                 name=f"kv-recv-{self.endpoint_id}<-link")
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, request: LinkRequest) -> None:
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
        try:
            while True:
                header = link.recv_header()
                if header.kind == MsgKind.BYE:
                    link.send_reply(Header(MsgKind.BYE), b"")
                    raise LinkError("the sender closed the link")
                unread = [header.nbytes > 0]

                def read_once(header: Header = header, unread: list[bool] = unread) -> torch.Tensor:
                    assert unread[0], "a payload is read at most once"
                    unread[0] = False
                    return link.read_payload(header)

                self.handle(link, header, read_once)
                if unread[0]:
                    link.read_payload(header)  # dropped: keep the stream in step
                for reply, payload in self.take_replies(link):
                    link.send_reply(reply, payload)
                if self._closed:
                    link.send_reply(Header(MsgKind.BYE), b"")
                    raise LinkError("the receiver closed")
        except LinkError as e:
            self.link_failed(link, str(e))
        except Exception as e:  # a bug or an allocation failure must not leave transfers waiting
            log.exception("KV receiver %s: link from %s failed", self.endpoint_id, request.sender)
            self.link_failed(link, f"internal error: {e!r}")
        finally:
            link.close()
