"""The KV transfer's configuration: which transport, where the two sides meet, and how long anything may block.

Every wait in `kv_transfer` is bounded by one of these numbers, so a dead or stalled peer always surfaces as an
error instead of a hang: `op_timeout_s` bounds one send, `liveness_s` bounds the silence on an idle pair
(senders ping every `keepalive_s`), `connect_timeout_s` bounds making a pair's group. A transfer's own
deadline is passed per request and enforced separately (see `kv_transfer.book.TransferBook`): the prefill
worker takes it from `transfer_timeout_s` (a prompt's KV, prefill to decode); a drained sequence's move
(decode to decode) gets what is left of the router's bound on the whole move (`RouterConfig.kv_move_timeout_s`)
with the call that starts it.

Standard library only: the serve process makes one for its workers without loading the transport (torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("torch", "ray")


@dataclass(frozen=True)
class KVTransferConfig:
    """How a worker's KV sender or receiver talks to its peers."""

    # "torch": pairwise torch.distributed groups (NCCL between CUDA caches, gloo otherwise);
    # "ray": the Ray object store, the fallback when the workers cannot open sockets to each other
    kv_transport: str = "torch"
    # the TCPStore both sides of every pair meet at (the router hosts it); torch transport only
    rendezvous_host: str | None = None
    rendezvous_port: int | None = None
    namespace: str = "pdserve/kv"  # key prefix in the store, so several deployments can share one
    # the deployment's secret: every link request is MACed with it (None: unauthenticated, tests only)
    secret: str | None = field(default=None, repr=False)
    connect_timeout_s: float = 30.0  # to make a pair's group: both sides must show up within it
    op_timeout_s: float = 5.0  # longest one send may block; past it the pair is declared dead
    keepalive_s: float = 1.0  # a sender pings each receiver at least this often, and gets a pong back
    liveness_s: float = 5.0  # silence on a pair longer than this breaks it (> 2 keepalives)
    # a prompt's KV transfer fails when this long passes without progress: from its opening to the first
    # layer, between two layers (each layer sent pushes the deadline on), or from the last layer to the
    # receiver's verdict (the prefill worker's deadline)
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"KVTransferConfig.kv_transport must be one of {TRANSPORTS}, "
                             f"got {self.kv_transport!r}")
        if self.kv_transport == "torch":
            if not self.rendezvous_host:
                raise ValueError("KVTransferConfig.rendezvous_host is required by the torch transport")
            if self.rendezvous_port is None or not 0 < self.rendezvous_port < 65536:
                raise ValueError("KVTransferConfig.rendezvous_port must be a TCP port for the torch transport, "
                                 f"got {self.rendezvous_port}")
        if not self.namespace:
            raise ValueError("KVTransferConfig.namespace must not be empty")
        for name in ("connect_timeout_s", "op_timeout_s", "keepalive_s", "liveness_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"KVTransferConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.liveness_s <= 2 * self.keepalive_s:
            raise ValueError(f"KVTransferConfig.liveness_s ({self.liveness_s}) must exceed two keepalives "
                             f"(keepalive_s={self.keepalive_s}), or idle pairs would be declared dead")
