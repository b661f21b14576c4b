"""Which Ray node the calling process runs on (workers and the serve process name themselves by it)."""

from __future__ import annotations


def node_identity() -> tuple[str, str]:
    """(node id, node IP) of the calling process as Ray knows them; ("local", "127.0.0.1") outside Ray.

    NOTE: the IP is the one the Ray node was started with (127.0.0.1 on a pinned local cluster), looked up in
    the cluster table; `ray.util.get_node_ip_address()` would guess from the routing table instead and
    return the machine's network address. Ray is imported here only, lazily: the rest of `protocol` is
    standard library.
    """
    try:
        import ray
    except ImportError:
        return "local", "127.0.0.1"
    if not ray.is_initialized():
        return "local", "127.0.0.1"
    node_id = ray.get_runtime_context().get_node_id()
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # ray ships this one without annotations
    ip: str = next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node_id)
    return node_id, ip
