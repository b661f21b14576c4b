"""Where the two sides of a pair meet: one TCPStore (the router hosts it), one accept queue per receiver.

No global world is ever formed, so pools grow and shrink freely.

Anything that reaches the store can push onto a queue, so a link request is authenticated: it carries an
HMAC-SHA256, under the deployment's secret (made by `pdserve serve`, handed to the workers through Ray),
over its fields, the receiver it is meant for and a timestamp; the receiver drops (and logs) a request whose
MAC is wrong, that is older than `MAX_REQUEST_AGE_S`, or whose link id it has already seen (a replay). A receiver listens on its own queue in the
store, named by its endpoint id and a random incarnation (a restarted worker never inherits a dead one's
requests). To open a link, a sender pushes a `LinkRequest` with a fresh link id onto that queue; both sides
then build a two-rank group under the store prefix `<namespace>/link/<link id>`, the sender as rank 0 and
the receiver as rank 1. The link id is unique, so no two groups ever share keys and neither side has to
agree with the other on any counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta

import torch
from torch.distributed import TCPStore


class RendezvousServer:
    """The store every pair meets at. One per deployment; the router owns it and its lifetime."""

    def __init__(self, host: str, port: int = 0) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"the rendezvous store must bind the node's cluster address, not {host!r}")
        # NOTE: wait_for_workers=False: clients come and go with the pools, there is no fixed world size.
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.host = host

    @property
    def port(self) -> int:
        return self._store.port

    def num_keys(self) -> int:
        """Plain keys in the store: the rendezvous keys of live links (two per gloo link). Queues are not
        counted (TCPStore keeps them apart)."""
        return self._store.num_keys()

    def close(self) -> None:
        del self._store


def connect_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the rendezvous store; `timeout_s` bounds connecting and every blocking call on it."""
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def accept_queue_key(namespace: str, endpoint_id: str, incarnation: str) -> str:
    return f"{namespace}/accept/{endpoint_id}/{incarnation}"


def link_prefix(namespace: str, link_id: str) -> str:
    return f"{namespace}/link/{link_id}"


def device_tag(device: torch.device) -> str:
    """'cpu', or 'cuda:<gpu uuid>' so two processes can tell whether they share a GPU."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def use_nccl(sender_device: str, receiver_device: str) -> bool:
    """NCCL between two different GPUs; otherwise gloo, staging CUDA layers through host memory.
    NOTE: NCCL refuses two ranks on one GPU (a single-GPU dev box running both pools)."""
    return (sender_device.startswith("cuda:") and receiver_device.startswith("cuda:")
            and sender_device != receiver_device)


# NOTE: anything that reaches the store can push onto an accept queue, so a receiver parses what it pops
# strictly and bounds it: a real request is three short strings, a few hundred bytes of JSON.
MAX_LINK_REQUEST_BYTES = 4096
_MAX_FIELD_CHARS = 256
_LINK_ID = re.compile(r"[0-9A-Za-z_-]+")  # it names store keys (`link_prefix`): no separators
_HEX64 = re.compile(r"[0-9a-f]{64}")


MAX_REQUEST_AGE_S = 120.0  # a link request older (or further in the future) than this is refused
_NO_MAC = "-"  # a deployment without a secret (tests of the transport alone)


@dataclass(frozen=True)
class LinkRequest:
    """What a sender pushes onto a receiver's accept queue."""

    sender: str  # the sender's endpoint id
    link_id: str  # fresh per link: also the nonce that makes a replay detectable
    device: str  # the sender's device_tag
    ts: str = "0"  # the sender's wall clock, integer milliseconds
    mac: str = _NO_MAC  # hex HMAC-SHA256 under the deployment's secret (`sign`)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def _message(self, receiver: str) -> bytes:
        return "\x1f".join(("pdserve-kv-link-v1", receiver, self.sender, self.link_id, self.device,
                            self.ts)).encode()

    @classmethod
    def signed(cls, sender: str, link_id: str, device: str, receiver: str, secret: str | None,
               now: float | None = None) -> LinkRequest:
        """A request for the receiver whose accept queue is `receiver`, made at `now` (default: this
        instant), MACed when there is a secret."""
        req = cls(sender, link_id, device, str(int((time.time() if now is None else now) * 1000)))
        return req if secret is None else dataclasses.replace(req, mac=req._mac(receiver, secret))

    def _mac(self, receiver: str, secret: str) -> str:
        return hmac.new(secret.encode(), self._message(receiver), hashlib.sha256).hexdigest()

    def verify(self, receiver: str, secret: str | None, now: float | None = None) -> None:
        """Raise ValueError unless this request was made for `receiver` by a holder of `secret`, recently."""
        if secret is None:
            return
        if not hmac.compare_digest(self._mac(receiver, secret), self.mac):
            raise ValueError(f"link request from {_clip(self.sender)} has a wrong MAC (not signed with this "
                             "deployment's secret)")
        age = (now if now is not None else time.time()) - int(self.ts) / 1000
        if not -MAX_REQUEST_AGE_S <= age <= MAX_REQUEST_AGE_S:
            raise ValueError(f"link request from {_clip(self.sender)} is {age:.0f}s old (limit "
                             f"{MAX_REQUEST_AGE_S:.0f}s): a replay, or clocks far apart")

    @classmethod
    def from_json(cls, raw: bytes | str) -> LinkRequest:
        """Parse one accept-queue entry. Raises ValueError, saying what is wrong, for anything other than
        a JSON object with exactly these fields, each a short printable string of the right form."""
        if len(raw) > MAX_LINK_REQUEST_BYTES:
            raise ValueError(f"link request of {len(raw)} bytes exceeds {MAX_LINK_REQUEST_BYTES}")
        try:
            obj = json.loads(raw)
        except RecursionError as e:  # deeply nested arrays: json's parser recurses
            raise ValueError("link request nests too deeply") from e
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
            raise ValueError(f"link request is not JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"link request is a JSON {type(obj).__name__}, not an object")
        names = {f.name for f in fields(cls)}
        if set(obj) != names:
            raise ValueError(f"link request has fields {sorted(obj)}, expected {sorted(names)}")
        for name in sorted(names):
            value = obj[name]
            if not isinstance(value, str) or not value or len(value) > _MAX_FIELD_CHARS or not value.isprintable():
                raise ValueError(f"link request field {name!r} must be a printable string of 1 to "
                                 f"{_MAX_FIELD_CHARS} characters, got {_clip(value)}")
        if not _LINK_ID.fullmatch(obj["link_id"]):
            raise ValueError(f"link request link_id {_clip(obj['link_id'])} is not [0-9A-Za-z_-]+")
        if obj["device"] != "cpu" and not obj["device"].startswith("cuda:"):
            raise ValueError(f"link request device {_clip(obj['device'])} is neither 'cpu' nor 'cuda:<uuid>'")
        if not obj["ts"].isdigit() or len(obj["ts"]) > 15:
            raise ValueError(f"link request ts {_clip(obj['ts'])} is not integer milliseconds")
        if obj["mac"] != _NO_MAC and not _HEX64.fullmatch(obj["mac"]):
            raise ValueError(f"link request mac {_clip(obj['mac'])} is not 64 hex digits")
        return cls(**obj)


def _clip(value: object, limit: int = 80) -> str:
    """A bounded repr for error messages: a garbage entry must not flood the log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
