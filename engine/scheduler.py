"""Continuous batching with chunked prefill under a per-step token budget.

Each step, running sequences are served first (one token per decoding sequence, the next chunk for a prompt
still prefilling), then waiting sequences are admitted FIFO within their priority class, higher classes
first, while the budget, the sequence limit and the free blocks allow. With `prefill_order="fair"`, decoding
sequences still come first, but every prompt (prefilling or waiting) then takes the budget in order of its
priority class, then of its uncomputed tokens, lowered by how many steps it has waited: a short prompt is
not stuck behind a long one, and the long one takes what is left of each step. All prompts together compute
at most `prefill_chunk_tokens` per step, which bounds a new prompt's wait for the step in progress
(Sarathi-Serve's token budget); while a higher priority class has been seen lately, the lower classes'
prompts compute at most `lower_class_chunk_tokens` per step, so a high-class prompt's wait is that smaller
step. A new sequence first takes whatever prefix of its prompt the prefix cache holds. When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its blocks are
freed and it is recomputed from scratch later (vLLM's recompute preemption).

With speculative decoding on, a decoding sequence's chunk also carries the proposer's draft tokens (as
many as k, its share of the step's draft cap, the budget, its max_tokens and the context allow); `update`
keeps the verified ones and rolls the rest back. When the drafts' blocks do not fit, the sequence decodes
plainly this step rather than preempting anyone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_allocator import BlockAllocator
from engine.config import SchedulerConfig, SpeculativeConfig, cdiv
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.spec_decode import Drafter
from protocol.messages import SpecCounts


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step (== request.num_computed_tokens)
    num_tokens: int  # the drafts included
    # speculative drafts after the sequence's last token, at positions request.num_tokens onwards
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk needs: one per draft plus one (its last token's)."""
        return len(self.draft_token_ids) + 1


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler itself, without a token

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.finished


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.drafter = Drafter(speculative or SpeculativeConfig(), config.max_num_batched_tokens)
        self.kv = KVCacheManager(allocator, block_size)
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.paused: dict[str, Request] = {}  # running sequences held out of the batch (a slow reader)
        self._step = 0  # schedule() calls so far: the clock fair order ages prompts by
        self._arrival_step: dict[str, int] = {}
        self._class_seen_step: dict[int, int] = {}  # priority class -> the last step it had a prompt here

    @property
    def spec_stats(self) -> SpecCounts:
        return self.drafter.counts

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self._arrival_step[request.request_id] = self._step
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def pause(self, request_id: str) -> bool:
        """Hold a running sequence out of the batch, keeping its blocks (its reader is behind)."""
        req = self.requests.get(request_id)
        if req is None or req not in self.running:
            return False
        self.running.remove(req)
        self.paused[request_id] = req
        return True

    def resume(self, request_id: str) -> bool:
        req = self.paused.pop(request_id, None)
        if req is None or req.is_finished:
            return False
        self.running.append(req)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._step += 1
        budget = self.config.max_num_batched_tokens
        fair = self.config.prefill_order == "fair"
        draft_share = self.drafter.share(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if fair and req.status == RequestStatus.PREFILLING:
                i += 1  # prompts take their turn below, in fair order
                continue
            drafts = self.drafter.propose(req, min(budget - 1, draft_share))
            if drafts and self.kv.grow(req, req.num_tokens + len(drafts)):
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1 + len(drafts), drafts))
                budget -= 1 + len(drafts)
                i += 1
                continue
            n = self._chunk_len(req, budget)
            if n == 0:  # a prompt whose last chunk waits for its KV destination
                i += 1
                continue
            while not self.kv.grow(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1

        if fair:
            self._schedule_prompts_fairly(out, budget)
            return out
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            # a higher priority class first; by arrival within a class (max keeps the first of equals)
            req = max(self.waiting, key=lambda r: r.params.priority)
            if self._end_if_too_large(req, out):
                continue
            if not self._admit(req, budget) and not self._admit_over_held(req, budget, out):
                break
            self.waiting.remove(req)  # (not popleft: a held prompt it displaced went back to the front)
            self.running.append(req)
            n = self._chunk_len(req, budget)
            if n:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
        return out

    def _admit_over_held(self, req: Request, budget: int, out: SchedulerOutput) -> bool:
        """FIFO admission when the blocks are full: preempt prompts held for their KV destination (most
        recent first) until `req` fits. Held prompts cannot use their blocks until a decode worker has room,
        and that room may be what a prompt waiting behind them holds reserved: letting them block admission
        would stall the worker until the router gives up on them."""
        held = [r for r in self.running if r.awaiting_destination]
        while held:
            victim = held.pop()
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if self._admit(req, budget):
                return True
        return False

    @staticmethod
    def _chunk_len(req: Request, budget: int) -> int:
        """The tokens of `req` this step may compute: what is left, within `budget`, short of the prompt's last
        token while the prompt waits for its KV destination (`Request.awaiting_destination`)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.awaiting_destination and req.num_computed_tokens + n >= req.num_tokens:
            n = req.num_tokens - req.num_computed_tokens - 1
        return n

    def _top_recent_class(self) -> int:
        """The highest priority class with a prompt here in the last `priority_memory_steps` steps."""
        memory = self.config.priority_memory_steps
        return max((c for c, step in self._class_seen_step.items() if self._step - step <= memory), default=0)

    def _schedule_prompts_fairly(self, out: SchedulerOutput, budget: int) -> None:
        """Prompts, prefilling and waiting alike, higher priority classes first, then by uncomputed tokens less
        their aging credit, together at most `prefill_chunk_tokens` this step, those of a class below the
        top recent one at most `lower_class_chunk_tokens`."""
        budget = min(budget, self.config.prefill_chunk_tokens or budget)
        lower = self.config.lower_class_chunk_tokens or budget
        rate = self.config.prefill_aging_tokens_per_step

        def key(r: Request) -> tuple[int, float]:
            waited = self._step - self._arrival_step[r.request_id]
            return -r.params.priority, (r.num_tokens - r.num_computed_tokens) - rate * waited

        prompts = sorted([r for r in self.running if r.status == RequestStatus.PREFILLING] + list(self.waiting),
                         key=key)
        for req in prompts:  # (a class waiting here is seen, however long ago it arrived)
            self._class_seen_step[req.params.priority] = self._step
        top = self._top_recent_class()
        for req in prompts:
            below = req.params.priority < top
            cap = min(budget, lower) if below else budget
            if budget <= 0:
                return
            if cap <= 0 or req.is_finished or req.status not in (RequestStatus.PREFILLING, RequestStatus.WAITING):
                continue  # the lower classes' share is spent; or preempted (or ended) as a victim in this loop
            n = self._chunk_len(req, cap)
            if n == 0:
                continue  # its last chunk waits for its KV destination
            if req.status == RequestStatus.PREFILLING:
                if not self._grow_or_preempt(req, req.num_computed_tokens + n, out):
                    continue  # no room this step: it waits, holding what it has
            else:
                if out.preempted or len(self.running) >= self.config.max_num_seqs:
                    continue
                if self._end_if_too_large(req, out):
                    continue
                if not self._admit(req, cap):
                    continue
                self.waiting.remove(req)
                self.running.append(req)
                n = self._chunk_len(req, cap)
                if n == 0:
                    continue  # its cached prefix left only the last chunk, which waits
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            lower -= n if below else 0

    def _end_if_too_large(self, req: Request, out: SchedulerOutput) -> bool:
        """End a waiting request larger than the whole cache (it grew there decoding): it can never run."""
        if self.kv.can_ever_fit(req.num_tokens):
            return False
        self.finish(req, RequestStatus.FINISHED_LENGTH if req.output_token_ids else RequestStatus.FINISHED_ERROR)
        out.finished.append(req)
        return True

    def _grow_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Blocks for a prefilling prompt's next chunk, preempting the most recently admitted sequence that
        has no chunk this step (as the FIFO order would); False when there is none to preempt."""
        scheduled = {id(c.request) for c in out.chunks}
        # (popped from the end: the most recently admitted first, and prompts held for their KV destination
        # last, since their KV is whole but for one token and they go on the moment it comes)
        victims = sorted((r for r in self.running if r is not req and id(r) not in scheduled),
                         key=lambda r: not r.awaiting_destination)
        need = cdiv(num_tokens, self.block_size) - len(req.block_ids)
        # NOTE: upper bound (a victim's blocks shared with a prefix another sequence holds do not free): when
        # even all of them cannot make room, preempt nobody and give the room back instead, as FIFO would
        if self.kv.allocator.num_free_blocks + sum(len(v.block_ids) for v in victims) < need:
            self.running.remove(req)
            self._preempt(req)
            out.preempted.append(req)
            return False
        while not self.kv.grow(req, num_tokens):
            if not victims:
                return False
            victim = victims.pop()
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        return True

    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Request]:
        """Advance every scheduled sequence by the tokens sampled for its chunk (one, or the verified
        drafts plus one); returns those that got new tokens this step (finished ones included: their
        status says so), each with `num_new_tokens` set."""
        advanced = []
        for chunk, tokens in zip(out.chunks, sampled):
            req = chunk.request
            if req.is_finished:
                continue  # aborted while the step ran
            decoding = bool(req.output_token_ids) and chunk.start == req.num_tokens - 1
            # NOTE: a verified chunk's KV is valid up to its last accepted draft; the slots after it hold
            # rejected drafts' KV, which the sequence's next chunks overwrite.
            req.num_computed_tokens = chunk.start + len(tokens) if chunk.draft_token_ids else chunk.end
            if not chunk.draft_token_ids:  # (a verified chunk's blocks are hashed once its tokens are in)
                self.kv.commit_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a partial prefill chunk: its sample is meaningless
            if decoding:
                self.drafter.count(chunk.draft_token_ids, tokens)
            req.num_new_tokens = 0
            advanced.append(req)
            if req.prefill_only:
                req.append_token(tokens[0])
                req.num_new_tokens = 1
                # the blocks stay pinned while the KV-transfer layer reads them; see `finish`
                req.status = RequestStatus.SENDING_KV
                self.running.remove(req)
                continue
            req.status = RequestStatus.RUNNING
            for token in tokens:
                req.append_token(token)
                req.num_new_tokens += 1
                stop = req.check_stop()
                if stop is not None:
                    self.finish(req, stop)
                    break
            else:
                if chunk.draft_token_ids:
                    self.kv.commit_full_blocks(req)
                    self.kv.trim(req)
        return advanced

    def reserve_for_kv(self, req: Request) -> list[int] | None:
        """Decode worker: hold blocks for a prompt whose KV another worker computes. The prompt's full
        blocks that this cache already holds are reused; the returned table covers the whole prompt, and
        the first `req.num_cached_tokens // block_size` of it need not be sent. None when out of room."""
        if not self.kv.reserve(req):
            return None
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.request_id] = req
        self._arrival_step[req.request_id] = self._step  # (a preempted one waits, and ages, like any prompt)
        return req.block_ids

    def forget_kv(self, request_id: str, start: int) -> bool:
        """Take a sequence's KV from position `start` (a block boundary) on out of the prefix cache: a check
        found it differs from what was sent, so no later prompt may reuse it. False for an unknown request."""
        req = self.requests.get(request_id) or self.paused.get(request_id)
        if req is None:
            return False
        self.kv.forget(req, start // self.kv.block_size)
        return True

    def kv_received(self, request_ids: list[str]) -> None:
        """Decode worker: these reserved prompts' KV has landed in their blocks (WAITING_FOR_KV -> KV_LANDED);
        unknown or finished ids are skipped."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_KV:
                req.status = RequestStatus.KV_LANDED

    def kv_landed(self, req: Request, first_token: int) -> bool:
        """The prompt's KV is in the reserved blocks (KV_LANDED; a WAITING_FOR_KV request is taken as landed)
        and its first token is known: start decoding. Returns True when that first token already ends it."""
        assert req.status in (RequestStatus.WAITING_FOR_KV, RequestStatus.KV_LANDED), \
            f"{req.request_id} is {req.status.name}"
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.commit_full_blocks(req)
        req.append_token(first_token)
        stop = req.check_stop()
        if stop is not None:
            self.finish(req, stop)
            return True
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return False

    def finish(self, req: Request, status: RequestStatus) -> None:
        assert status.is_finished
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.paused.pop(req.request_id, None)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._arrival_step.pop(req.request_id, None)

    # -- blocks (`KVCacheManager`) ------------------------------------------------------------------------

    def _admit(self, req: Request, budget: int) -> bool:
        """A waiting request's blocks (its cached prefix, then fresh ones for this step): it prefills."""
        if not self.kv.admit(req, budget):
            return False
        req.status = RequestStatus.PREFILLING
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: its blocks go back and it waits at the front, to start over."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
