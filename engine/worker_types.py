"""Plain data the workers and the router exchange (Ray pickles these; no behaviour lives here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.block_hash import BlockHash
from engine.llm_engine import EngineLoad


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    kind: str  # "prefill" | "decode" | "colocated"
    node_id: str
    node_ip: str
    block_size: int
    num_blocks: int
    kv_address: Any = None  # a decode worker's KV receiver address (kv_transfer.PeerAddress)


@dataclass
class LoadReport:
    """A worker's load plus the prefix-cache changes since its last report (for the router's index)."""

    worker_id: str
    load: EngineLoad
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


def node_identity() -> tuple[str, str]:
    """(node id, node IP) of the calling process as Ray knows them; ("local", "127.0.0.1") outside Ray.

    NOTE: the IP is the one the Ray node was started with (127.0.0.1 on a pinned local cluster), looked up in
    the cluster table; `ray.util.get_node_ip_address()` would guess from the routing table instead and
    return the machine's network address.
    """
    try:
        import ray
    except ImportError:
        return "local", "127.0.0.1"
    if not ray.is_initialized():
        return "local", "127.0.0.1"
    node_id = ray.get_runtime_context().get_node_id()
    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    return node_id, ip
