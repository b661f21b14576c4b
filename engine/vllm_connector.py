"""pdserve's KV connector for vLLM: vLLM's `KVConnectorBase_V1`, loaded by module path (no fork of vLLM).

vLLM builds two instances of a connector, one beside its scheduler and one beside each model runner. The
scheduler's lives in the worker's process, on the engine loop's thread, and talks to the `VllmEngine` that
owns it through this module's `BRIDGE` (one engine per process: vLLM's own global state allows no more). With
one device the model runner is on that thread too; with tensor parallelism each rank's runs in a child
process of vLLM's, with a `BRIDGE` of its own that holds only its caches, so everything a rank must act on
travels in the step's connector metadata (`_Meta`), which vLLM hands every rank. The connector moves no bytes
over the network itself: pdserve's `kv_transfer` does, driven by the workers as with the built-in engine.
What the connector gives them:

- **Layer-wise sends** (prefill): `save_kv_layer` runs after each layer's KV is written, and calls the step's
  layer hook (`EngineBackend.step`'s `layer_hook_for`), so the prefill worker ships each layer as vLLM
  computes it (one device; over ranks the engine reads the blocks back after the step, `engine.vllm_ranks`).
  A prefill-only request's blocks outlive its vLLM request (`request_finished` holds them) until the engine
  releases them, once its transfer is done (`finished_sending`, which every rank reports from the metadata).
- **Loads** (decode): a request whose prompt's KV landed in the engine's staging cache reports those tokens
  as computed remotely (`get_num_new_matched_tokens`, asynchronous); once vLLM allocated its blocks
  (`update_state_after_alloc`), the staged blocks go into the step's metadata, every rank's `start_load_kv`
  copies its own KV heads of them into its cache (`heads_of_rank`), and reports the request ready
  (`finished_recving`).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine.vllm_layout import VllmCpuLayout, heads_of_rank

# what a request's `SamplingParams.extra_args["kv_transfer_params"]` asks of the connector
SEND = "pdserve_send"  # prefill-only: hold the blocks after the request ends, until released
LOAD = "pdserve_load"  # this many prompt tokens' KV wait in the staging cache

_LAYER = re.compile(r"layers\.(\d+)\.")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class Load:
    """Staged KV to copy into a request's vLLM blocks before the forward that first computes it."""

    vllm_id: str  # vLLM's own id for the request (the engine maps it to pdserve's)
    block_ids: list[int]  # vLLM blocks, from the first block to load
    first_block: int  # the prompt block index `block_ids[0]` holds
    # those blocks' KV, every KV head, in vLLM's byte order: [layers, 2, len(block_ids), block_size, kv_heads,
    # head_dim] (`engine.vllm_layout`); set by the engine's `stage` when the metadata is built
    kv: torch.Tensor | None = None


@dataclass
class Bridge:
    """What the engine and the connector instances in its process share (all on the engine loop's thread)."""

    kv_caches: dict[str, torch.Tensor] | None = None  # this process's per-layer caches, as registered
    layout: VllmCpuLayout | None = None  # and the pdserve-shaped view over them (this rank's KV heads)
    on_schedule: Callable[[Any], None] | None = None  # the engine sees each step's schedule, before the forward
    layer_hook: Callable[[int], None] | None = None  # this step's per-layer hook, set by `on_schedule`
    stage: Callable[[Load], torch.Tensor] | None = None  # the engine hands over a load's staged KV
    releases: set[str] = field(default_factory=set)  # vLLM ids whose held blocks may go
    landed: set[str] = field(default_factory=set)  # vLLM ids whose KV this process loaded this step


BRIDGE = Bridge()


class _Meta(KVConnectorMetadata):  # type: ignore[misc]
    def __init__(self, loads: dict[str, Load], releases: set[str]) -> None:
        self.loads = loads
        self.releases = releases  # held blocks that may go: every rank reports them sent


def _rank() -> tuple[int, int]:
    """(This process's tensor-parallel rank, the number of ranks): (0, 1) with one device."""
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _end_with_the_worker() -> None:
    """This rank's process is SIGKILLed when the worker's ends (Linux's parent-death signal). vLLM's ranks
    watch their parent themselves, but only while they run: a SIGSTOPped rank outlived its worker, stopped,
    holding its memory. (The signal follows the thread that started the rank, the thread that built the
    engine: a worker's main thread, which lives as long as the worker.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed for a vLLM rank's process")
    if parent is not None and os.getppid() != parent.pid:  # the worker ended before the signal was set
        os._exit(1)


def my_layout() -> VllmCpuLayout:
    assert BRIDGE.layout is not None, "vLLM registered no KV caches with the pdserve connector here"
    return BRIDGE.layout


class PdserveConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._allocated: dict[str, Load] = {}  # scheduler side: loads whose blocks were just allocated
        self._layer_index: dict[str, int] = {}

    # -- worker side ------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if multiprocessing.parent_process() is not None:  # a tensor-parallel rank: a child of the worker
            _end_with_the_worker()
        BRIDGE.kv_caches = dict(kv_caches)
        BRIDGE.layout = VllmCpuLayout.for_engine(kv_caches, self._vllm_config, self._block_size)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        rank, tp_size = _rank()
        cache = my_layout().blocks.tensor
        for vllm_id, load in meta.loads.items():
            assert load.kv is not None, f"the pdserve connector's load of {vllm_id} carries no KV"
            mine = load.kv[..., heads_of_rank(load.kv.shape[-2], tp_size, rank), :]
            cache.index_copy_(2, torch.tensor(load.block_ids, dtype=torch.int64), mine)
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
        sending = set(self._get_connector_metadata().releases)
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
        for load in loads.values():
            assert BRIDGE.stage is not None, "a pdserve connector without its engine"
            load.kv = BRIDGE.stage(load)
        releases, BRIDGE.releases = BRIDGE.releases, set()
        return _Meta(loads, releases)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return bool((request.kv_transfer_params or {}).get(SEND)), None
