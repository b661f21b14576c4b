"""vLLM as an engine under pdserve's pools: `VllmEngine` runs a vLLM engine in-process behind `EngineBackend`.

One vLLM `LLMEngine` per worker process, with no process of its own (`engine.vllm_boot`): the
worker's engine loop thread calls `step`, as it does the built-in engine's. vLLM schedules, batches, pages
and computes; pdserve keeps, per request, the same `engine.request.Request` the workers read (its status,
tokens, blocks), mirrored from vLLM's outputs and schedule. pdserve decides when a sequence stops (vLLM runs
with `ignore_eos` and no stop tokens; the mirror's `check_stop` ends it and aborts the vLLM request), so both
engines stop on exactly the same rule.

KV transfer goes through `engine.vllm_connector` and pdserve's own `kv_transfer`:

- **Prefill**: a prefill-only request runs in vLLM to its first token (`max_tokens=1`); each step's schedule
  reaches the worker's layer hook before the forward, and each layer's write calls it (`save_kv_layer`), so
  its KV ships layer by layer from vLLM's blocks, read in place through `kv_cache` (`engine.vllm_layout`:
  pdserve's shape over vLLM's memory, whole blocks in vLLM's byte order; `kv_of` reads by position through
  it). The blocks are held past the vLLM request's end until the worker `finish`es it.
- **Decode**: a reservation is blocks of a staging cache (`engine.vllm_staging`, `landing_cache`), since vLLM
  allocates its own blocks only when it schedules a request. Once the KV has landed and the first token is
  known, the request enters vLLM as prompt + first token, its prompt's tokens reported as computed remotely;
  vLLM allocates, the connector copies the staged blocks in before the forward, and vLLM computes the first
  token's KV and samples the second: nothing of the prompt is recomputed.

Tensor parallelism (`EngineConfig.tensor_parallel_size`): vLLM's ranks run in child processes of the worker;
the worker reads their KV through a mirror (`engine.vllm_ranks`), so a prefill over ranks ships after its last
step instead of layer by layer, and everything else is as with one device.

vLLM's KV cache events feed the router's prefix index (`engine.vllm_events`). What vLLM does not offer
in-process is left out, said here: `pause` (backpressure) answers False, and a drain `hold`s a sequence by
ending its vLLM request with its blocks kept; speculative decoding is vLLM's own business (not configured).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.backend import EngineBackend, EngineDead, LayerHookFactory
from engine.config import EngineConfig, cdiv
from engine.hub import log, resolve_model
from engine.kv_cache import KVCache
from engine.request import Request, RequestStatus
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.vllm_boot import eos_token_ids, import_vllm, start_vllm
from engine.vllm_events import VllmCacheEvents
from engine.vllm_layout import tokens_of
from engine.vllm_ranks import RankMirror
from engine.vllm_staging import StagingCache
from protocol.messages import EngineLoad, LoadReport, StepStats


class VllmEngine(EngineBackend):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        path = resolve_model(config.model)
        import_vllm()  # first: its environment, and the install command when it is missing
        from engine import vllm_connector

        self._bridge = vllm_connector.BRIDGE
        self._bridge.on_schedule = self._on_schedule
        self._bridge.stage = self._stage
        self.llm = start_vllm(config, path)
        self._scheduler = self.llm.engine_core.engine_core.scheduler
        # vLLM's KV cache events (block stored / removed) feed the router's prefix index, as pdserve hashes
        block_size = config.cache.block_size
        self._cache_events = self._scheduler.kv_event_publisher = VllmCacheEvents(block_size)

        self.max_model_len = self.llm.model_config.max_model_len
        self._ranks: RankMirror | None = None  # tensor parallelism: the ranks' KV, read into the worker
        if config.tensor_parallel_size > 1:
            self._ranks = RankMirror(self.llm, self.num_blocks + 1)
            self.kv_cache, self.cache_spec = self._ranks.cache, self._ranks.spec
        else:
            # vLLM's memory in pdserve's shape, its bytes in vLLM's order: what the transport ships; `kv_of`
            # reads it by position through `vllm_layout.tokens_of`
            layout = self._bridge.layout
            assert layout is not None, "vLLM registered no KV caches with the pdserve connector"
            self.kv_cache, self.cache_spec = layout.blocks, layout.spec
        self.eos_token_ids = eos_token_ids(path)
        self.last_step: StepStats | None = None
        self._requests: dict[str, Request] = {}  # every unfinished request, by pdserve id
        self._vllm_ids: dict[str, str] = {}  # pdserve id -> vLLM's id, while vLLM has the request
        self._pdserve_ids: dict[str, str] = {}  # and back
        self._paused: dict[str, Request] = {}  # sequences held for a drain's move, their blocks kept
        self._held: set[str] = set()  # vLLM ids whose blocks the connector holds for a send
        self._schedule: SchedulerOutput | None = None  # the step in progress, as `_on_schedule` saw it
        self._layer_hook_for: LayerHookFactory | None = None
        self._ranks_hook: Callable[[int], None] | None = None  # over ranks: the step's hook, run after it
        self._staging: StagingCache | None = None  # made on first use (decode workers)
        log(f"vLLM engine ready for {config.model} in {time.perf_counter() - t0:.1f}s: "
            f"{self.num_blocks} KV blocks of {block_size} tokens, {self.cache_spec.dtype}, {self.kv_cache.device}")

    # -- requests ---------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return int(self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block

    @property
    def requests(self) -> Mapping[str, Request]:
        return self._requests

    @property
    def paused(self) -> Mapping[str, Request]:
        return self._paused

    def pause(self, request_id: str) -> bool:
        return False  # vLLM offers no pause in-process: backpressure buffers the tokens instead

    def resume(self, request_id: str) -> bool:
        return False

    def hold(self, request_id: str) -> bool:
        """A drain's hold: the vLLM request ends, its blocks kept by the connector (as a prefill's are for
        its send), so the sequence's KV can still be read and moved until the router aborts it here."""
        if request_id in self._paused:
            return True
        vllm_id, request = self._vllm_ids.get(request_id), self._requests.get(request_id)
        if vllm_id is None or request is None:
            return False
        running = self._scheduler.requests.get(vllm_id)
        # NOTE: its KV must cover every token but the last (the last step's sample), as a drain's move needs
        if running is None or running.is_finished() or running.num_computed_tokens != request.num_tokens - 1:
            return False
        from engine.vllm_connector import SEND

        request.block_ids = list(self._scheduler.kv_cache_manager.get_block_ids(vllm_id)[0])
        running.kv_transfer_params = {**(running.kv_transfer_params or {}), SEND: True}
        self._held.add(vllm_id)
        self.llm.abort_request([vllm_id], internal=True)
        self._paused[request_id] = request
        if self._ranks is not None:  # a drain's send reads the worker's mirror
            self._ranks.read(request.block_ids)
        return True

    def kv_of(self, request_id: str, num_tokens: int, start: int = 0) -> Any:
        """By position, so through `vllm_layout.tokens_of`: both caches hold blocks in vLLM's byte order."""
        if self._staging is not None and request_id in self._staging:  # landed, not loaded into vLLM yet
            return self._staging.tokens(request_id, num_tokens, start)
        req = self._requests.get(request_id) or self._paused.get(request_id)
        if req is None or req.num_computed_tokens < num_tokens:
            return None
        if self._ranks is not None:
            size = self.cache_spec.block_size
            self._ranks.read(req.block_ids[start // size:cdiv(num_tokens, size)])
        return tokens_of(self.kv_cache.tensor, req.block_ids, num_tokens, start)

    def enqueue(self, request: Request) -> None:
        extra = {"kv_transfer_params": {"pdserve_send": True}} if request.prefill_only else None
        self._add(request, request.prompt_token_ids, 1 if request.prefill_only else request.params.max_tokens, extra)

    def _add(self, request: Request, tokens: list[int], max_tokens: int, extra: dict[str, Any] | None) -> None:
        from vllm import SamplingParams as VllmParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        params = VllmParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                            seed=p.seed, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=False,
                            extra_args=extra)
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if p.cache_salt:
            # NOTE: vLLM salts its own prefix cache (as ours does); the router's index of this worker's blocks
            # (`publish`) sees salted blocks as unsalted chains, which only blurs placement hints
            prompt["cache_salt"] = p.cache_salt
        vllm_id = self.llm.add_request(request.request_id, prompt, params)
        self._vllm_ids[request.request_id] = vllm_id
        self._pdserve_ids[vllm_id] = request.request_id
        self._requests[request.request_id] = request
        if request.prefill_only:
            self._held.add(vllm_id)

    def abort_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._requests.pop(request.request_id, None)
        self._paused.pop(request.request_id, None)
        self._release_staging(request.request_id)
        vllm_id = self._vllm_ids.pop(request.request_id, None)
        if vllm_id is None:
            return
        self._pdserve_ids.pop(vllm_id, None)
        running = self._scheduler.requests.get(vllm_id)
        if running is not None and not running.is_finished():
            self.llm.abort_request([vllm_id], internal=True)
        if vllm_id in self._held:  # a send's blocks: vLLM frees them on the next step's `finished_sending`
            self._held.discard(vllm_id)
            self._bridge.releases.add(vllm_id)

    # -- KV from another engine (decode side) -----------------------------------------------------------

    @property
    def landing_cache(self) -> KVCache:
        """The staging cache reservations point into: half as many blocks as vLLM's cache, at least one
        longest prompt's (made on first use, so prefill and colocated workers spend no memory on it)."""
        return self._staging_cache().cache

    def _staging_cache(self) -> StagingCache:
        if self._staging is None:
            n = max(self.num_blocks // 2, cdiv(self.max_model_len, self.cache_spec.block_size))
            self._staging = StagingCache(self.cache_spec, n, self.kv_cache.device)
        return self._staging

    def reserve_for_kv(self, request: Request) -> list[int] | None:
        n = cdiv(request.num_prompt_tokens, self.cache_spec.block_size)
        blocks = self._staging_cache().reserve(request.request_id, n) if n <= self._free_vllm_blocks() else None
        if blocks is None:
            return None
        request.block_ids = blocks
        request.status = RequestStatus.WAITING_FOR_KV
        self._requests[request.request_id] = request
        return blocks

    def kv_received(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None and request.status is RequestStatus.WAITING_FOR_KV:
                request.status = RequestStatus.KV_LANDED

    def kv_landed(self, request: Request, first_token: int) -> bool:
        request.append_token(first_token)
        stop = request.check_stop()
        if stop is not None:
            self.finish(request, stop)
            return True
        request.status = RequestStatus.RUNNING
        # the prompt's KV is staged: vLLM loads it (the connector) and computes only the first token's
        self._add(request, request.all_token_ids, request.params.max_tokens - 1,
                  {"kv_transfer_params": {"pdserve_load": request.num_prompt_tokens}})
        return False

    def _stage(self, load: Any) -> Any:
        """The connector's load, as vLLM allocated its blocks: the staged KV for the step's metadata (every
        rank copies its heads of it in during the step, before the request's first forward); the staging
        blocks go back."""
        rid = self._pdserve_ids[load.vllm_id]
        assert self._staging is not None
        kv = self._staging.take(rid, load.first_block, len(load.block_ids))
        request = self._requests[rid]  # its prompt's KV is in vLLM's blocks from this step on
        request.block_ids = list(self._scheduler.kv_cache_manager.get_block_ids(load.vllm_id)[0])
        request.num_computed_tokens = request.num_prompt_tokens
        return kv

    def _release_staging(self, request_id: str) -> None:
        if self._staging is not None:
            self._staging.release(request_id)

    def _free_vllm_blocks(self) -> int:
        return int(self._scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    # -- the step loop ----------------------------------------------------------------------------------

    def has_scheduled_work(self) -> bool:
        # NOTE: vLLM's `has_requests`, not `has_unfinished_requests`: a finished send's held blocks are
        # freed only by a step, which must run even with nothing to compute. A dead executor's step raises
        # `EngineDead` at once, so the worker ends before a request is placed on it
        return bool(self._scheduler.has_requests() or self._bridge.releases or self._dead)

    @property
    def _dead(self) -> bool:
        """A rank's process died: vLLM's multiprocess executor marks itself failed (its monitor thread), and
        fails every step from then on."""
        return bool(getattr(self.llm.engine_core.engine_core.model_executor, "is_failed", False))

    def _on_schedule(self, out: Any) -> None:
        """vLLM's schedule for this step, as pdserve's (the connector calls it before the forward)."""
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        chunks = []
        manager = self._scheduler.kv_cache_manager
        for vllm_id, n in out.num_scheduled_tokens.items():
            request = self._requests.get(self._pdserve_ids.get(vllm_id, ""))
            if request is None:
                continue
            if request.status is RequestStatus.WAITING:
                request.status = RequestStatus.PREFILLING
            request.block_ids = list(manager.get_block_ids(vllm_id)[0])
            chunks.append(ScheduledChunk(request, starts[vllm_id], n))
        self._schedule = SchedulerOutput(chunks)
        hook = self._layer_hook_for(self._schedule) if self._layer_hook_for is not None else None
        if self._ranks is None:
            self._bridge.layer_hook = hook
        else:  # the ranks compute in their own processes: the worker ships their KV after the step
            self._ranks_hook = hook

    def step(self, layer_hook_for: LayerHookFactory | None = None) -> tuple[SchedulerOutput, list[Request]]:
        if self._dead:
            raise EngineDead("vLLM's executor failed: a tensor-parallel rank's process died")
        t0 = time.perf_counter()
        self._schedule, self._layer_hook_for = None, layer_hook_for
        try:
            outputs = self.llm.step()
            schedule = self._schedule or SchedulerOutput()
            if self._ranks_hook is not None:
                self._ship_from_ranks(schedule, self._ranks_hook)
        except Exception as e:
            if self._dead:
                raise EngineDead(f"vLLM's executor failed: a tensor-parallel rank's process died "
                                 f"({e})") from e
            raise
        finally:
            self._bridge.layer_hook, self._layer_hook_for, self._ranks_hook = None, None, None
        for chunk in schedule.chunks:
            chunk.request.num_computed_tokens = chunk.end
        advanced = []
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            tokens = output.outputs[0].token_ids if output.outputs else []
            if not request.output_token_ids and output.num_cached_tokens:  # a prompt computed here
                request.num_cached_tokens = output.num_cached_tokens  # vLLM's own prefix-cache hit
            request.num_new_tokens = 0
            for token in tokens:
                request.append_token(token)
                request.num_new_tokens += 1
                stop = request.check_stop()
                if stop is not None or request.prefill_only:
                    break
            else:
                stop = RequestStatus.FINISHED_LENGTH if output.finished else None
            if request.prefill_only and request.output_token_ids:
                request.status = RequestStatus.SENDING_KV  # done in vLLM; its blocks held for the send
            elif stop is not None:
                self.finish(request, stop)
            else:
                request.status = RequestStatus.RUNNING
            if request.num_new_tokens:
                advanced.append(request)
        seconds = time.perf_counter() - t0
        prompt = [max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in schedule.chunks]
        total = max(1, schedule.num_tokens)
        for c, n in zip(schedule.chunks, prompt):
            if n:
                c.request.prefill_compute_s += seconds * c.num_tokens / total
        if schedule.chunks:
            self.last_step = StepStats(seconds, sum(prompt), sum(1 for n in prompt if not n))
        return schedule, advanced

    def _ship_from_ranks(self, schedule: SchedulerOutput, hook: Callable[[int], None]) -> None:
        """Over ranks, after the step: the prompts it finished into the mirror, then every layer's hook."""
        finished = [c.request.block_ids for c in schedule.chunks
                    if c.request.prefill_only and c.end == c.request.num_prompt_tokens]
        assert self._ranks is not None
        self._ranks.read([b for blocks in finished for b in blocks])
        for layer in range(self.cache_spec.num_layers):
            hook(layer)

    # -- load and the prefix cache ----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        s = self._scheduler
        waiting = [r for r in self._requests.values() if r.status in (RequestStatus.WAITING, RequestStatus.PREFILLING)]
        free, total = self._free_vllm_blocks(), self.num_blocks
        staging = self._staging
        if staging is not None:  # a decode worker reserves staging blocks: that is its room
            free, total = min(free, staging.num_free), min(total, staging.num_blocks)
        return EngineLoad(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            queued_prefill_tokens=sum(r.num_prompt_tokens - r.num_computed_tokens for r in waiting),
            free_blocks=free,
            total_blocks=total,
            cached_blocks=len(self._cache_events.hashes),
            reserved_blocks=staging.num_reserved if staging is not None else 0,
        )

    def load_report(self, worker_id: str, since: int | None) -> LoadReport:
        if since is None:
            log = self._cache_events.log
            return LoadReport(worker_id, self.load(), since=log.seq, seq=log.seq)
        c = self._cache_events.log.changes(since, self._cache_events.hashes.values())
        return LoadReport(worker_id, self.load(), c.stored, c.removed, c.since, c.seq, c.full)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        return None
