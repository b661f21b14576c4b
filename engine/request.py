"""A request's state inside one engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from protocol.block_hash import BlockHash, hash_blocks, salt_root
from protocol.kinds import FinishReason


class RequestStatus(enum.IntEnum):
    """A request's life, in order; every state from FINISHED_STOPPED on is final."""

    WAITING = enum.auto()  # queued for prefill (or re-queued after preemption)
    PREFILLING = enum.auto()  # prompt chunks being computed
    # prefill worker: the prompt computed and its first token sampled; its blocks stay pinned until the worker
    # collects its KV transfer's result (it reads this status, and finishes the request then)
    SENDING_KV = enum.auto()
    # decode worker: blocks reserved, KV not landed yet (vLLM's WAITING_FOR_REMOTE_KVS); the worker reports
    # the ids its receiver finished (`Scheduler.kv_received`), which moves them on
    WAITING_FOR_KV = enum.auto()
    KV_LANDED = enum.auto()  # decode worker: the KV is in the reserved blocks; waiting for the first token
    RUNNING = enum.auto()  # decoding: one token per step (more when speculative drafts are accepted)
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or the context length
    FINISHED_ABORTED = enum.auto()  # cancelled by the client
    FINISHED_ERROR = enum.auto()  # a failure (KV transfer, worker) ended it

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of every full block of all tokens
    num_new_tokens: int = 0  # tokens the last step appended (more than one when drafts were accepted)
    # engine step seconds spent on the prompt, each step's time shared among its chunks by token count
    prefill_compute_s: float = 0.0
    # prefill worker: stop after the first token and hold the blocks (SENDING_KV) until the KV has shipped
    prefill_only: bool = False
    # prefill worker: the decode worker's blocks are not reserved yet, so the prompt's last chunk (whose step
    # ships its KV) must wait; every chunk before it may run
    awaiting_destination: bool = False

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "empty prompt reached the engine"
        self.block_hashes = hash_blocks(self.prompt_token_ids, self.block_size,
                                        parent=salt_root(self.params.cache_salt))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        if self.num_tokens % self.block_size == 0:
            tokens = self.all_token_ids
            parent = self.block_hashes[-1] if self.block_hashes else salt_root(self.params.cache_salt)
            self.block_hashes += hash_blocks(tokens, self.block_size, len(self.block_hashes), parent)

    def check_stop(self) -> RequestStatus | None:
        """The finished state the last appended token puts this request in, if any."""
        token = self.output_token_ids[-1]
        if not self.params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in self.params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
