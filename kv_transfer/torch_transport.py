"""The torch.distributed transport: a pairwise group per (sender, receiver), made on demand.

Sender side: the first `begin` towards a receiver opens a link (see `rendezvous`), which then carries every
later transfer to that receiver until it breaks; a broken link fails its transfers and the next `begin`
opens a fresh one. Receiver side: a listener thread pops link requests off the receiver's accept queue and
serves each link on its own thread: take the next message (waiting at most `liveness_s`; the sender
pings), hand it to the core, send the replies the core queued. If the store goes away, existing links
carry on and the listener retries with backoff.

The links themselves, and their framing, are `kv_transfer.torch_links`'.

What a worker needs: the rendezvous store's address (in the config), its own endpoint id, and its node IP
(`host`), which gloo binds to and advertises to the peer.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
import uuid
import weakref
from collections import OrderedDict

import torch
from torch.distributed import DistStoreError

from engine.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig
from kv_transfer.pair_group import (
    RECEIVER_RANK,
    SENDER_RANK,
    PairGroup,
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
from kv_transfer.torch_links import TorchRecvLink, TorchSendLink, _Incoming
from kv_transfer.wire import Header, LinkError, MsgKind, SendLink
from protocol.messages import PeerAddress

log = logging.getLogger(__name__)

_LISTEN_TIMEOUT_S = 3600.0  # a listener's blocking pop; close() wakes it with a sentinel instead
_MAX_SEEN_LINKS = 100_000  # link ids remembered against replays (far more than open within MAX_REQUEST_AGE_S)
_CLOSE = "close"


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
