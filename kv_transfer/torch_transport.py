"""The torch.distributed transport: a pairwise group per (sender, receiver), made on demand.

Sender side: the first `begin` towards a receiver opens a link (see `rendezvous`), which then carries every
later transfer to that receiver until it breaks; a broken link fails its transfers and the next `begin`
opens a fresh one. Receiver side: a listener thread pops link requests off the receiver's accept queue and
serves each link on its own thread: read a header (waiting at most `liveness_s`; the sender pings), read
its payload, hand both to the core, send the replies the core queued.

What a worker needs: the rendezvous store's address (in the config), its own endpoint id, and its node IP
(`host`), which gloo binds to and advertises to the peer.
"""

from __future__ import annotations

import logging
import threading
import uuid

import torch
from torch.distributed import DistStoreError

from engine.kv_cache import KVCache
from kv_transfer.base import PeerAddress
from kv_transfer.config import KVTransferConfig
from kv_transfer.pair_group import RECEIVER_RANK, SENDER_RANK, TAG_DATA, TAG_REPLY, PairGroup
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


class _Staging:
    """A grow-only receive buffer, reused message after message (the core is done with it by then)."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8, device=self.buf.device)
        return self.buf[:nbytes]


class TorchSendLink(SendLink):
    def __init__(self, group: PairGroup, config: KVTransferConfig) -> None:
        self._group = group
        self._config = config
        self.payload_device = group.nccl_device or torch.device("cpu")

    def send(self, header: Header, payload: torch.Tensor | None) -> None:
        timeout = self._config.op_timeout_s
        self._group.send(header.to_tensor(), TAG_DATA, timeout)
        if payload is not None and payload.numel():
            if header.kind == MsgKind.LAYER and self._group.nccl is not None:
                self._group.send_nccl(payload, timeout)
            else:
                self._group.send(payload, TAG_DATA, timeout)

    def recv_reply(self) -> tuple[Header, bytes]:
        raw = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._group.recv(raw, TAG_REPLY, self._config.liveness_s)
        header = Header.from_tensor(raw)
        payload = torch.empty(header.nbytes, dtype=torch.uint8)
        if header.nbytes:
            self._group.recv(payload, TAG_REPLY, self._config.op_timeout_s)
        return header, payload.numpy().tobytes()

    def close(self) -> None:
        self._group.close()


class TorchRecvLink(RecvLink):
    def __init__(self, group: PairGroup, peer_id: str, config: KVTransferConfig) -> None:
        self.peer_id = peer_id
        self._group = group
        self._config = config
        self._cpu = _Staging(torch.device("cpu"))
        self._gpu = _Staging(group.nccl_device) if group.nccl_device is not None else None

    def recv_header(self) -> Header:
        raw = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._group.recv(raw, TAG_DATA, self._config.liveness_s)
        return Header.from_tensor(raw)

    def read_payload(self, header: Header) -> torch.Tensor:
        if header.kind == MsgKind.LAYER and self._gpu is not None:
            buf = self._gpu.take(header.nbytes)
            self._group.recv_nccl(buf, self._config.op_timeout_s)
        else:
            buf = self._cpu.take(header.nbytes)
            self._group.recv(buf, TAG_DATA, self._config.op_timeout_s)
        return buf

    def send_reply(self, header: Header, payload: bytes) -> None:
        self._group.send(header.to_tensor(), TAG_REPLY, self._config.op_timeout_s)
        if payload:
            self._group.send(bytes_tensor(payload), TAG_REPLY, self._config.op_timeout_s)

    def close(self) -> None:
        self._group.close()


class TorchKVSender(LayerwiseSender):
    """`KVSender` over pairwise gloo/NCCL groups. `host`: this worker's node IP."""

    transport = "torch"

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig, host: str) -> None:
        if config.kv_transport != "torch":
            raise ValueError(f"KVTransferConfig.kv_transport is {config.kv_transport!r}, not 'torch'")
        super().__init__(endpoint_id, cache, config)
        self.host = host
        self._device = device_tag(cache.device)

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
        self._listener = threading.Thread(target=self._listen, daemon=True, name=f"kv-accept-{endpoint_id}")
        self._listener.start()

    @property
    def address(self) -> PeerAddress:
        return self._address

    def close(self) -> None:
        if not self._close_transfers():
            return
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
        while True:
            try:
                raw = self._listen_store.queue_pop(self._queue)
            except DistStoreError:
                continue  # nobody asked for an hour
            except RuntimeError as e:
                log.error("KV receiver %s stops accepting links: the rendezvous store failed: %s",
                          self.endpoint_id, e)
                return
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
        link = TorchRecvLink(group, request.sender, cfg)
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
        finally:
            link.close()
