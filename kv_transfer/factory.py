"""Making a worker's sender or receiver from its config: the only place that picks a transport."""

from __future__ import annotations

from engine.kv_cache import KVCache
from kv_transfer.base import KVReceiver, KVSender
from kv_transfer.config import KVTransferConfig


def create_sender(config: KVTransferConfig, endpoint_id: str, cache: KVCache, host: str) -> KVSender:
    """The prefill worker's sender. `endpoint_id`: its stable name (receivers' `expect(src=...)` uses it);
    `host`: its node IP (what gloo binds to; ignored by the Ray transport)."""
    if config.kv_transport == "ray":
        from kv_transfer.ray_transport import RayKVSender  # NOTE: imports ray only when asked for

        return RayKVSender(endpoint_id, cache, config)
    from kv_transfer.torch_transport import TorchKVSender

    return TorchKVSender(endpoint_id, cache, config, host)


def create_receiver(config: KVTransferConfig, endpoint_id: str, cache: KVCache, host: str) -> KVReceiver:
    """The decode worker's receiver; publish its `address` to the router."""
    if config.kv_transport == "ray":
        from kv_transfer.ray_transport import RayKVReceiver

        return RayKVReceiver(endpoint_id, cache, config)
    from kv_transfer.torch_transport import TorchKVReceiver

    return TorchKVReceiver(endpoint_id, cache, config, host)
