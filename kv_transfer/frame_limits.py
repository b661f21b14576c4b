"""What a peer may put in a message header: every size is checked before anything is allocated for it.

A header says how many payload bytes follow (`Header.nbytes`), and a receiver must post a buffer of that
size before the bytes can arrive. So a header is checked first against what the link can legitimately
carry: a LAYER against the transfer it names (known on this link, whole layers of its descriptor, within
its layer range), a BEGIN against the largest descriptor this cache could take, an ABORT or a reply against
a small fixed bound, and a PING or BYE carries nothing. A header that fails is a protocol violation: the
link is closed (`LinkError`), and nothing was allocated for it.
"""

from __future__ import annotations

from kv_transfer.layout import TransferDescriptor
from kv_transfer.wire import Header, LinkError, MsgKind

# NOTE: every transport's `SendLink.max_message_bytes` is at most this: a sender coalesces consecutive layers
# up to it, and only a single layer may be larger. So a message of several layers is never larger.
MAX_COALESCED_BYTES = 64 << 20
MAX_ABORT_BYTES = 64 << 10  # an ABORT: a request id and a short reason, as JSON
MAX_REPLY_BYTES = 64 << 10  # a NACK's or BYE's reason (a receiver clips what it sends to this)
_DESCRIPTOR_FIXED_BYTES = 64 << 10  # a descriptor's JSON apart from its block ids (request id, shape)


def max_descriptor_bytes(num_blocks: int) -> int:
    """The largest BEGIN payload a receiver with `num_blocks` cache blocks could take: the fixed fields and
    at most every block id once (each at most as many digits as `num_blocks`, and a comma)."""
    return _DESCRIPTOR_FIXED_BYTES + num_blocks * (len(str(num_blocks)) + 1)


def check_bare(header: Header, limit: int, sender: str) -> None:
    """A message whose payload is not a layer: at most `limit` bytes (0: none)."""
    if not 0 <= header.nbytes <= limit:
        raise LinkError(f"{sender} sent a {header.kind.name} of {header.nbytes} bytes; at most {limit} may follow "
                        "one")


def check_layer(header: Header, desc: TransferDescriptor, sender: str) -> None:
    """A LAYER message of the transfer `desc`: whole layers of it, inside its layer range, and no more
    layers at once than a sender coalesces (`MAX_COALESCED_BYTES`, or a single layer)."""
    count, rest = divmod(header.nbytes, desc.layer_nbytes)
    if (rest or count < 1 or not desc.layer_start <= header.layer <= desc.layer_stop - count
            or (count > 1 and header.nbytes > MAX_COALESCED_BYTES)):
        raise LinkError(f"{sender} sent a malformed LAYER for transfer {desc.request_id!r} (seq {header.seq}, "
                        f"layer {header.layer}, {header.nbytes} bytes; its layers are {desc.layer_nbytes} bytes "
                        f"each, [{desc.layer_start}, {desc.layer_stop}))")


def check_reply(header: Header, receiver: str) -> None:
    """A reply (PONG, ACK, NACK, BYE) from the receiver: a reason of at most `MAX_REPLY_BYTES`."""
    if header.kind not in (MsgKind.PONG, MsgKind.ACK, MsgKind.NACK, MsgKind.BYE):
        raise LinkError(f"{receiver} replied with a {header.kind.name}, which is no reply")
    check_bare(header, MAX_REPLY_BYTES, receiver)


def clip_reason(reason: bytes) -> bytes:
    """A reply's reason, cut to what a sender accepts."""
    return reason if len(reason) <= MAX_REPLY_BYTES else reason[:MAX_REPLY_BYTES - 3] + b"..."
