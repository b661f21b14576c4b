"""The engine a worker drives: the interface both worker roles call, whatever runs the model behind it.

The built-in `LLMEngine` is one implementation; a vLLM engine is meant to be a second. A worker touches its
engine only through these methods (on its `EngineLoop`'s thread: an engine is not thread-safe), and the
engine's requests are `engine.request.Request`s whose `status` is the one state of a request on its worker,
its KV transfer included (`RequestStatus.SENDING_KV`, `WAITING_FOR_KV`, `KV_LANDED`).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.kv_cache import read_positions
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from protocol.messages import EngineLoad, LoadReport, StepStats

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput

LayerHook = Callable[[int], None]  # called after each layer's KV is written, with the layer's index
LayerHookFactory = Callable[["SchedulerOutput"], LayerHook | None]


class EngineDead(RuntimeError):
    """The engine can never step again (a vLLM rank's process died): the worker ends, so that its supervisor
    replaces it and its requests move, instead of failing every request placed on it from then on."""


class EngineBackend(ABC):
    """One model replica with its paged KV cache and its scheduler, as a worker sees it."""

    # the KV cache's layout (`engine.kv_cache.KVCacheSpec`: layers, block size, bytes per block) and the
    # cache itself (what a KV transport reads and writes: `engine.kv_cache.KVCache`)
    cache_spec: Any
    kv_cache: Any
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    last_step: StepStats | None  # what the latest step that ran anything computed

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """The KV cache's size in blocks."""

    # -- requests ---------------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prefill_only: bool = False, awaiting_destination: bool = False) -> Request:
        """A request for this engine's cache and model (not queued yet)."""
        return Request(request_id, prompt_token_ids, params, self.cache_spec.block_size, self.eos_token_ids,
                       self.max_model_len, prefill_only=prefill_only, awaiting_destination=awaiting_destination)

    @abstractmethod
    def enqueue(self, request: Request) -> None:
        """Queue a request for prefill."""

    @abstractmethod
    def abort_request(self, request_id: str) -> None:
        """End a request and free its blocks; a no-op for an unknown one."""

    @abstractmethod
    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in final state `status` and free its blocks (full ones stay in the prefix cache)."""

    @property
    @abstractmethod
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request here, by id (queued, running, paused or waiting for its KV)."""

    @property
    @abstractmethod
    def paused(self) -> Mapping[str, Request]:
        """Running sequences held out of the batch (`pause`), by id."""

    @abstractmethod
    def pause(self, request_id: str) -> bool:
        """Hold a running sequence out of the batch, keeping its blocks. False when it is not running."""

    @abstractmethod
    def resume(self, request_id: str) -> bool:
        """Put a paused sequence back into the batch."""

    def hold(self, request_id: str) -> bool:
        """Take a running sequence out of the batch for good, its KV kept for a drain's move (it is then
        aborted). False when it cannot be held (not running, or its KV is gone)."""
        return request_id in self.paused or self.pause(request_id)

    def kv_of(self, request_id: str, num_tokens: int, start: int = 0) -> Any:
        """K and V of a sequence's positions `start` to `num_tokens`, [num_layers, 2, num_tokens - start,
        kv_heads, head_dim], reading only the blocks that hold them; None when it holds no KV for them here."""
        req = self.requests.get(request_id) or self.paused.get(request_id)
        if req is None or req.num_computed_tokens < num_tokens:
            return None
        return read_positions(self.kv_tensor(), req.block_ids, num_tokens, start)

    def kv_digest(self, request_id: str, num_tokens: int, start: int = 0) -> str | None:
        """SHA-256 of the bytes of `kv_of(request_id, num_tokens)` from position `start` on: what both ends of
        a KV transfer or move must agree on bit for bit (`--verify-kv-moves`). None when it holds no KV for
        them here.

        A transfer skips the blocks the destination's prefix cache holds already, so its check starts after
        them: those blocks are the destination's own KV for the same tokens, computed on another path (a decode
        step rather than a prefill chunk, another batch shape) and equal only to rounding."""
        kv = self.kv_of(request_id, num_tokens, start)
        if kv is None:
            return None
        return hashlib.sha256(kv.contiguous().cpu().view(-1).view(torch.uint8).numpy()).hexdigest()

    def forget_kv(self, request_id: str, start: int) -> bool:
        """Take a sequence's KV from position `start` on out of the prefix cache (its check failed: it differs
        from what was sent). False when the request is unknown, or the engine cannot: vLLM keeps its prefix
        cache to itself, and a failed check there leaves the blocks cached (the worker logs it)."""
        return False

    # -- KV from another engine (decode side) -----------------------------------------------------------

    @property
    def landing_cache(self) -> Any:
        """Where KV from another engine lands (a receiver writes here): the cache itself, unless the engine
        allocates its blocks only when it schedules (vLLM: a staging cache it loads from)."""
        return self.kv_cache

    @abstractmethod
    def reserve_for_kv(self, request: Request) -> list[int] | None:
        """Blocks for a prompt whose KV another engine computes (the request goes to WAITING_FOR_KV): its
        whole table, the cached prefix first (`request.num_cached_tokens`). None when out of room."""

    @abstractmethod
    def kv_received(self, request_ids: list[str]) -> None:
        """These requests' KV has landed in their reserved blocks: WAITING_FOR_KV -> KV_LANDED."""

    @abstractmethod
    def kv_landed(self, request: Request, first_token: int) -> bool:
        """A KV_LANDED request's first token is known: it decodes on. True when that token ends it."""

    # -- the step loop ----------------------------------------------------------------------------------

    @abstractmethod
    def has_scheduled_work(self) -> bool:
        """Whether `step` may compute anything."""

    @abstractmethod
    def step(self, layer_hook_for: LayerHookFactory | None = None) -> tuple[SchedulerOutput, list[Request]]:
        """One step: what was scheduled, and the requests that got tokens (`num_new_tokens` set).
        `layer_hook_for` sees the schedule before the model runs and may return a per-layer hook."""

    @abstractmethod
    def load(self) -> EngineLoad:
        ...

    @abstractmethod
    def load_report(self, worker_id: str, since: int | None) -> LoadReport:
        """The load and the prefix-cache changes after change number `since` (None: the newest's number)."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds."""

    def kv_tensor(self) -> Any:
        """The cache as one tensor, [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        return self.kv_cache.tensor


def create_engine(config: EngineConfig) -> EngineBackend:
    """The engine `config.backend` names (vLLM is imported only when asked for)."""
    if config.backend == "vllm":
        from engine.vllm_engine import VllmEngine

        return VllmEngine(config)
    from engine.llm_engine import LLMEngine

    return LLMEngine(config)
