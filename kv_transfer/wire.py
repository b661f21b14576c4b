"""Messages between one sender and one receiver, and the two ends of the link that carries them.

Every message is a small fixed header, then `nbytes` of payload when `nbytes > 0` (how the two travel is
the transport's business: the torch link frames both into one gloo message when it can). Many transfers share one
link: the sender numbers each transfer on the link (`seq`) and the header says which transfer a message
belongs to, so the receiver dispatches without any per-transfer channel.

    sender -> receiver: PING | BEGIN(seq, descriptor) | LAYER(seq, first layer, packed KV of k >= 1 layers)
                        | ABORT(seq, request id + reason) | BYE
    receiver -> sender: PONG | ACK(seq) | NACK(seq, reason) | BYE

The sender pings at least every `keepalive_s` and the receiver answers each ping, so both directions carry
traffic on an idle pair and a silent peer is detected by a bounded wait rather than by hoping.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

PROTOCOL_VERSION = 2
HEADER_LEN = 5  # int64s: version, kind, seq, layer, nbytes


class MsgKind(enum.IntEnum):
    PING = 1
    PONG = 2
    BEGIN = 3
    LAYER = 4
    ABORT = 5
    ACK = 6
    NACK = 7
    BYE = 8


class Header(NamedTuple):
    kind: MsgKind
    seq: int = 0  # the transfer's number on its link
    layer: int = 0
    nbytes: int = 0  # payload bytes that follow

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([PROTOCOL_VERSION, int(self.kind), self.seq, self.layer, self.nbytes], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        version, kind, seq, layer, nbytes = t.tolist()
        if version != PROTOCOL_VERSION:
            raise LinkError(f"peer speaks KV wire protocol {version}, this side {PROTOCOL_VERSION}")
        try:
            return cls(MsgKind(kind), seq, layer, nbytes)
        except ValueError as e:
            raise LinkError(f"unknown message kind {kind}") from e


class LinkError(RuntimeError):
    """The link to a peer is broken (peer died, went silent, or broke the protocol). Every transfer on it
    fails; the next transfer to that peer makes a new link."""


def bytes_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


class SendLink(ABC):
    """The sender's end of one sender->receiver link. One thread sends, another receives replies; the
    transport that made it closes it when both are done."""

    # where layer payloads must be for `send`: "cpu", or the cache's CUDA device when the link is NCCL
    payload_device: torch.device
    # the largest payload this link sends best as one message; consecutive ready layers are coalesced up to
    # it (a single layer may exceed it)
    max_message_bytes: int

    @abstractmethod
    def staging(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes` on `payload_device` to pack the next LAYER payload into. The link
        hands out a buffer only once no earlier message still uses it (reused: no page faults per message)."""

    @abstractmethod
    def send(self, header: Header, payload: torch.Tensor | None) -> None:
        """Send a header and its payload (flat uint8 of `header.nbytes`; the link keeps it alive until it is
        out). May return before the message is out, and blocks while the link has too many unfinished
        (boundedly: a few `op_timeout_s`); LinkError when the link is broken."""

    @abstractmethod
    def idle(self) -> None:
        """The sender has nothing more to send for now: make sure what `send` got goes out without further
        calls (a link may batch messages), without waiting for it; LinkError when the link is broken."""

    @abstractmethod
    def flush(self) -> None:
        """Wait until every message given to `send` is out; LinkError as `send`. Called before closing."""

    @abstractmethod
    def recv_reply(self) -> tuple[Header, bytes]:
        """The next reply and its payload. Blocks at most `liveness_s`; LinkError when the link is broken."""

    @abstractmethod
    def close(self) -> None:
        """Release the link's resources. Idempotent."""


class RecvLink(ABC):
    """The receiver's end of one link, as the receiver core sees it: who is at the other end and how to
    answer. Reading is driven by the transport (see `LayerwiseReceiver.handle`)."""

    peer_id: str  # the sender's endpoint id

    @abstractmethod
    def send_reply(self, header: Header, payload: bytes) -> None:
        """Send one reply; LinkError when the link is broken. Called only from the link's receiving thread."""
