"""The Ray object-store transport: the fallback when workers cannot open sockets to each other.

Same cores, same protocol as the torch transport (see `wire`); only the link differs. A message is a tuple
(link id, sender id, header, body) put into the receiver process's `KVInbox`; a LAYER's body is
`[ObjectRef]` of its packed bytes (`ray.put`, zero-copy on the receiving node's side), others carry bytes.
Replies go to the link's reply box in the same inbox. Every Ray call is bounded by a timeout; a dead
receiver surfaces as a failed call (its inbox dies with it), a dead sender as a failed fetch (it owned the
layer objects) or, if it died between layers, as the transfer's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import warnings
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from engine.kv_cache import KVCache
from kv_transfer.config import KVTransferConfig
from kv_transfer.frame_limits import MAX_COALESCED_BYTES
from kv_transfer.ray_inbox import process_inbox
from kv_transfer.receiver import LayerwiseReceiver
from kv_transfer.rendezvous import device_tag
from kv_transfer.sender import LayerwiseSender
from kv_transfer.wire import Header, LinkError, MsgKind, RecvLink, SendLink
from protocol.messages import PeerAddress

log = logging.getLogger(__name__)

_POLL_S = 0.25  # long-poll slice of a take(): bounds how long close() waits for a reading thread
_BATCH = 8  # messages per inbox call when the sender has a backlog


def _rx_box(address: PeerAddress) -> str:
    return f"rx/{address.endpoint_id}/{address.incarnation}"


def _reply_box(link_id: str) -> str:
    return f"reply/{link_id}"


def _fetch(ref: ray.ObjectRef, timeout_s: float) -> torch.Tensor:
    try:
        array = ray.get(ref, timeout=timeout_s)
    except (GetTimeoutError, RayError) as e:
        raise LinkError(f"layer bytes unreachable: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return _as_tensor(array)


def _as_tensor(array: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only view into the object store: only read
        return torch.from_numpy(array)


class RaySendLink(SendLink):
    def __init__(self, sender_id: str, dst: PeerAddress, config: KVTransferConfig) -> None:
        self.payload_device = torch.device("cpu")
        self.max_message_bytes = MAX_COALESCED_BYTES  # the object store favours few, large objects
        self._sender_id = sender_id
        self._link_id = uuid.uuid4().hex
        self._dst = dst
        self._config = config
        self._replies: list[tuple[Header, bytes]] = []
        self._outbox: list[Any] = []
        self._staging = torch.empty(0, dtype=torch.uint8)

    def staging(self, nbytes: int) -> torch.Tensor:
        # one buffer is enough: `ray.put` in `send` copies it into the object store
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    def send(self, header: Header, payload: torch.Tensor | None) -> None:
        body: Any = b""
        if payload is not None and payload.numel():
            array = payload.numpy()
            body = [ray.put(array)] if header.kind == MsgKind.LAYER else array.tobytes()
        self._outbox.append((self._link_id, self._sender_id, tuple(header), body))
        if len(self._outbox) >= _BATCH:
            self.flush()

    def idle(self) -> None:
        self.flush()

    def flush(self) -> None:
        """One inbox call for everything sent since the last flush."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        try:
            ray.get(self._dst.inbox.put.remote(_rx_box(self._dst), items), timeout=self._config.op_timeout_s)
        except (GetTimeoutError, RayError) as e:
            raise LinkError(f"receiver's inbox unreachable: {type(e).__name__}: {str(e).splitlines()[0]}") from e

    def recv_reply(self) -> tuple[Header, bytes]:
        deadline = time.monotonic() + self._config.liveness_s
        while not self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkError(f"receiver silent for {self._config.liveness_s:.3g}s")
            try:
                items = ray.get(self._dst.inbox.take.remote(_reply_box(self._link_id), min(left, _POLL_S)),
                                timeout=left + self._config.op_timeout_s)
            except (GetTimeoutError, RayError) as e:
                raise LinkError(f"receiver's inbox unreachable: {type(e).__name__}: "
                                f"{str(e).splitlines()[0]}") from e
            self._replies.extend((Header(MsgKind(h[0]), *h[1:]), body) for h, body in items)
        return self._replies.pop(0)

    def close(self) -> None:
        self._dst.inbox.drop.remote(_reply_box(self._link_id))


class RayRecvLink(RecvLink):
    def __init__(self, peer_id: str, link_id: str, inbox: Any) -> None:
        self.peer_id = peer_id
        self._box = _reply_box(link_id)
        self._inbox = inbox
        self.last_seen = time.monotonic()

    def send_reply(self, header: Header, payload: bytes) -> None:
        # NOTE: fire and forget: the box is in this process's own inbox actor, and the sender long-polls it
        self._inbox.put.remote(self._box, [(tuple(header), payload)])


class RayKVSender(LayerwiseSender):
    """`KVSender` over the Ray object store. Needs `ray.init` done in this process."""

    transport = "ray"

    def _connect(self, dst: PeerAddress) -> SendLink:
        if dst.inbox is None:
            raise LinkError(f"receiver address {dst.endpoint_id!r} carries no inbox handle")
        return RaySendLink(self.endpoint_id, dst, self.config)


class RayKVReceiver(LayerwiseReceiver):
    """`KVReceiver` over the Ray object store. Needs `ray.init` done in this process."""

    def __init__(self, endpoint_id: str, cache: KVCache, config: KVTransferConfig) -> None:
        super().__init__(endpoint_id, cache, config)
        self._inbox = process_inbox(config.connect_timeout_s)
        self._address = PeerAddress("ray", endpoint_id, uuid.uuid4().hex[:12], device_tag(cache.device),
                                    inbox=self._inbox)
        self._links: dict[str, RayRecvLink] = {}
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-recv-{endpoint_id}")
        self._thread.start()

    @property
    def address(self) -> PeerAddress:
        return self._address

    def close(self) -> None:
        if not self._close_transfers():
            return
        self._thread.join(timeout=_POLL_S + self.config.op_timeout_s)
        self._book.close()

    def _run(self) -> None:
        box, cfg = _rx_box(self._address), self.config
        while True:
            try:
                items = ray.get(self._inbox.take.remote(box, _POLL_S), timeout=_POLL_S + cfg.op_timeout_s)
            except GetTimeoutError:
                continue  # a slow inbox is not a dead one: it is in this process's own fate
            except RayError:
                return  # ray is shutting down with the process
            fetched = self._prefetch(items)
            for link_id, sender_id, raw_header, body in items:
                self._on_item(link_id, sender_id, Header(MsgKind(raw_header[0]), *raw_header[1:]), body, fetched)
            for link in list(self._links.values()):
                self._flush(link)
            if self._closed:
                for link in self._links.values():
                    link.send_reply(Header(MsgKind.BYE), b"")
                self._inbox.drop.remote(box)
                return
            self._forget_idle_links()

    def _prefetch(self, items: list[Any]) -> dict[Any, Any]:
        """Fetch every layer of a batch in one call; on any failure fetch none, and let each item's own fetch
        find out which link is broken."""
        refs = [body[0] for _, _, _, body in items if isinstance(body, list)]
        if len(refs) < 2:
            return {}
        try:
            return dict(zip(refs, ray.get(refs, timeout=self.config.op_timeout_s), strict=True))
        except (GetTimeoutError, RayError):
            return {}

    def _on_item(self, link_id: str, sender_id: str, header: Header, body: Any, fetched: dict[Any, Any]) -> None:
        link = self._links.get(link_id)
        if link is None:
            link = self._links[link_id] = RayRecvLink(sender_id, link_id, self._inbox)
        link.last_seen = time.monotonic()
        if header.kind == MsgKind.BYE:
            link.send_reply(Header(MsgKind.BYE), b"")
            self.link_failed(link, "the sender closed the link")
            del self._links[link_id]
            return

        def read() -> torch.Tensor:
            if not isinstance(body, list):
                return torch.frombuffer(bytearray(body), dtype=torch.uint8)
            array = fetched.pop(body[0], None)
            return _fetch(body[0], self.config.op_timeout_s) if array is None else _as_tensor(array)

        try:
            self.handle(link, header, read)
        except Exception as e:  # LinkError, or a bug: either way only this link's transfers fail
            if not isinstance(e, LinkError):
                log.exception("KV receiver %s: link from %s failed", self.endpoint_id, sender_id)
            self.link_failed(link, str(e) if isinstance(e, LinkError) else f"internal error: {e!r}")
            del self._links[link_id]

    def _flush(self, link: RayRecvLink) -> None:
        for reply, payload in self.take_replies(link):
            link.send_reply(reply, payload)

    def _forget_idle_links(self) -> None:
        # a sender that vanished without BYE: its transfers end by their deadlines, its link by silence
        cutoff = time.monotonic() - 4 * self.config.liveness_s
        for link_id, link in list(self._links.items()):
            if link.last_seen < cutoff:
                self.link_failed(link, "the sender went silent")
                del self._links[link_id]
