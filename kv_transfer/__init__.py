"""kv_transfer: ship paged KV blocks from a prefill worker to a decode worker, layer by layer.

    decode worker                                   prefill worker
    blocks = allocator.allocate(n)
    receiver.expect(rid, src, blocks, deadline)
    -- hands receiver.address + blocks to the router -->
                                                    sender.begin(rid, dst, src_blocks, blocks, deadline)
                                                    for each layer: compute; sender.send_layer(rid, layer)
    <== BEGIN(descriptor), LAYER 0..L-1 (one packed buffer each), over a pairwise link ==
    scatter each layer into `blocks`; ACK ==>
    receiver.pop_finished() -> DONE: admit the sequence    sender.pop_finished() -> free src blocks
                               FAILED: free `blocks`

Files, one concept each: `base` (the interface and its ownership contract), `config`, `layout` (the
descriptor and the pack/scatter of a layer), `wire` (messages and link ends), `book` (transfers, deadlines,
results), `sender` / `receiver` (the transport-independent cores), `rendezvous` + `pair_group` +
`torch_transport` (gloo/NCCL groups made on demand per pair), `ray_inbox` + `ray_transport` (the Ray
object-store fallback), `factory` (choosing one from the config).
"""

from __future__ import annotations

from kv_transfer.base import KVReceiver, KVSender, TransferResult, TransferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.factory import create_receiver, create_sender
from kv_transfer.layout import LayoutMismatch, TransferDescriptor
from kv_transfer.rendezvous import RendezvousServer

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "LayoutMismatch",
    "RendezvousServer",
    "TransferDescriptor",
    "TransferResult",
    "TransferStatus",
    "create_receiver",
    "create_sender",
]
