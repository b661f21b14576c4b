"""Transfer configuration: `KVTransferConfig` lives in `protocol.kv_config` (standard library only), so the
serve process can make the workers' without importing this package (and torch); re-exported here."""

from __future__ import annotations

from protocol.kv_config import TRANSPORTS, KVTransferConfig

__all__ = ["TRANSPORTS", "KVTransferConfig"]
