"""pdserve's KV connector for vLLM: vLLM's `KVConnectorBase_V1`, loaded by module path (no fork of vLLM).

vLLM builds two instances of a connector, one beside its scheduler and one beside its model runner; in the
in-process engine pdserve runs (`engine.vllm_engine`) both live on the engine loop's thread, and talk to the
`VllmEngine` that owns them through this module's `BRIDGE` (one engine per process: vLLM's own global state
allows no more). The connector moves no bytes over the network itself: pdserve's `kv_transfer` does, driven
by the workers as with the built-in engine. What the connector gives them:

- **Layer-wise sends** (prefill): `save_kv_layer` runs after each layer's KV is written, and calls the step's
  layer hook (`EngineBackend.step`'s `layer_hook_for`), so the prefill worker ships each layer as vLLM
  computes it. A prefill-only request's blocks outlive its vLLM request (`request_finished` holds them) until
  the engine releases them, once its transfer is done (`finished_sending`).
- **Loads** (decode): a request whose prompt's KV landed in the engine's staging cache reports those tokens
  as computed remotely (`get_num_new_matched_tokens`, asynchronous); once vLLM allocated its blocks
  (`update_state_after_alloc`), the next forward's `start_load_kv` copies the staged blocks in and reports the
  request ready (`finished_recving`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

# what a request's `SamplingParams.extra_args["kv_transfer_params"]` asks of the connector
SEND = "pdserve_send"  # prefill-only: hold the blocks after the request ends, until released
LOAD = "pdserve_load"  # this many prompt tokens' KV wait in the staging cache

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """Staged KV to copy into a request's vLLM blocks before the forward that first computes it."""

    vllm_id: str  # vLLM's own id for the request (the engine maps it to pdserve's)
    block_ids: list[int]  # vLLM blocks, from the first block to load
    first_block: int  # the prompt block index `block_ids[0]` holds


@dataclass
class Bridge:
    """What the engine and its two connector instances share (all on the engine loop's thread)."""

    kv_caches: dict[str, torch.Tensor] | None = None  # vLLM's per-layer caches, as registered
    on_schedule: Callable[[Any], None] | None = None  # the engine sees each step's schedule, before the forward
    layer_hook: Callable[[int], None] | None = None  # this step's per-layer hook, set by `on_schedule`
    load: Callable[[Load], None] | None = None  # the engine copies staged KV in
    releases: set[str] = field(default_factory=set)  # vLLM ids whose held blocks may go
    landed: set[str] = field(default_factory=set)  # vLLM ids whose KV was loaded this step


BRIDGE = Bridge()


class _Meta(KVConnectorMetadata):  # type: ignore[misc]
    def __init__(self, loads: dict[str, Load]) -> None:
        self.loads = loads


class PdserveConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._allocated: dict[str, Load] = {}  # scheduler side: loads whose blocks were just allocated
        self._layer_index: dict[str, int] = {}

    # -- worker side ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        BRIDGE.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for vllm_id, load in meta.loads.items():
            assert BRIDGE.load is not None, "a pdserve connector without its engine"
            BRIDGE.load(load)
            BRIDGE.landed.add(vllm_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are copied whole before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if BRIDGE.layer_hook is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            match = _LAYER.search(layer_name)
            assert match is not None, f"no layer index in vLLM's layer name {layer_name!r}"
            layer = self._layer_index[layer_name] = int(match.group(1))
        BRIDGE.layer_hook(layer)

    def wait_for_save(self) -> None:
        return None  # the sender owns its sends; the blocks stay held until they are done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, BRIDGE.releases = BRIDGE.releases, set()
        recving, BRIDGE.landed = BRIDGE.landed, set()
        return sending or None, recving or None

    # -- scheduler side ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        n = params.get(LOAD, 0) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        total = (request.kv_transfer_params or {})[LOAD]
        local = total - num_external_tokens  # block-aligned: what vLLM's own prefix cache held
        first, stop = local // self._block_size, -(-total // self._block_size)
        ids = blocks.get_block_ids()[0]
        self._allocated[request.request_id] = Load(request.request_id, list(ids[first:stop]), first)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if BRIDGE.on_schedule is not None:
            BRIDGE.on_schedule(scheduler_output)
        loads, self._allocated = self._allocated, {}
        return _Meta(loads)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return bool((request.kv_transfer_params or {}).get(SEND)), None
