"""The router's settings (`RouterConfig`), checked once when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import RouterId
from router.cost_model import CostPriors

__all__ = ["RouterConfig"]


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    policy: str = "prefix"  # "prefix" | "round-robin"
    max_queue: int = 256  # requests waiting for KV room before RESOURCE_EXHAUSTED
    admission_timeout_s: float = 60.0  # a request waits this long for room or a live worker, then fails
    # a prefill worker takes no new prompt while this many prompt tokens wait on it (the one exception: an
    # idle worker takes any prompt the model admits)
    max_queued_prefill_tokens: int = 65536
    migration_limit: int = 3  # attempts after the first, per request
    call_timeout_s: float = 10.0  # reserve/start/submit/abort: the worker answers between two steps
    # backpressure: a stream with this many undelivered decode steps is paused on its decode worker, and
    # resumed once the client has read it down to a quarter of that
    max_buffered_steps: int = 64
    # "joint": the (prefill, decode) pair -- or the decode worker alone for a short uncached prompt -- with the
    # lowest estimated time until the request decodes (router.cost_model); "separate": the prefill worker by
    # prefix and load, then a decode worker for it by node and free blocks (the baseline)
    placement: str = "joint"
    # joint placement may prefill a prompt on its decode worker when that is cheaper (off by default: it trades
    # the decode worker's streams' ITL for the request's TTFT, which the operator must choose to do)
    local_prefill: bool = False
    local_chunk_tokens: int = 0  # the most prompt tokens a decode worker's step computes (0: no cap)
    # a prompt longer than its prefill worker's horizon (`WorkerInfo.destination_horizon_tokens`) gets its
    # decode blocks when that worker nears its last chunk, not at placement: they would sit idle meanwhile
    late_reservation: bool = True
    # the share of each decode worker's cache this router may promise to such prompts: 1 / the number of
    # router replicas, which promise independently, so that together they promise at most one cache
    promise_share: float = 1.0
    kv_move_timeout_s: float = 60.0  # a drain's KV move (reserve, push every layer, start) must end in this
    # compare a SHA-256 of every moved sequence's KV at the source and the destination before decoding on
    # (a full read of its KV on both: a debugging and proof aid, off in production)
    verify_kv_moves: bool = False
    cost_priors: CostPriors = field(default_factory=CostPriors)  # the cost model's stand-ins (router.cost_model)
    router_id: RouterId = None  # this replica's among several (`pdserve serve --routers N`); None: a lone router

    def __post_init__(self) -> None:
        if self.policy not in ("prefix", "round-robin"):
            raise ValueError(f"routing policy must be 'prefix' or 'round-robin', got {self.policy!r}")
        if self.placement not in ("joint", "separate"):
            raise ValueError(f"--placement must be 'joint' or 'separate', got {self.placement!r}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 < self.promise_share <= 1:
            raise ValueError(f"promise_share must be in (0, 1], got {self.promise_share}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.max_buffered_steps < 4:
            raise ValueError(f"max_buffered_steps must be >= 4, got {self.max_buffered_steps}")
        if self.max_queued_prefill_tokens < 1:
            raise ValueError(f"--max-queued-prefill-tokens must be >= 1, got {self.max_queued_prefill_tokens}")

