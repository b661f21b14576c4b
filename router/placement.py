"""Where a request runs: pure functions over load snapshots (no Ray, no gRPC, no clocks).

Prefill: the worker that would finish this prompt's prefill soonest, in tokens. Computing a prompt costs
roughly its uncached tokens, and the worker first has to get through the prefill tokens already queued on
it, so for worker w:

    cost(w) = (prompt tokens - tokens w holds in its prefix cache) + w.queued_prefill_tokens

The lowest cost wins; ties go to the worker with fewest running sequences, then the smallest worker id (so
the choice is deterministic). A long cached prefix therefore wins over a short queue, and a long queue loses
to an idle worker when the prefix it saves is small.

Decode: the KV has to travel from the prefill worker, so a decode worker on the same node (no network hop)
is preferred when one has room for the request's blocks; among those, and otherwise among all with room,
the most free blocks wins. No room anywhere is a normal answer (None): the router queues the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from protocol.block_hash import BlockHash
from protocol.kinds import Path, PoolKind
from router.cost_model import CostModel
from router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load as last reported to the router."""

    worker_id: str
    node_id: str  # the Ray node: same node -> KV moves without a network hop
    pool: PoolKind
    num_running: int = 0  # sequences in its running batch
    num_waiting: int = 0  # sequences queued on it
    queued_prefill_tokens: int = 0  # prompt tokens scheduled on it but not yet computed
    free_blocks: int = 0  # KV blocks it can still hand out (evictable cached blocks included)
    total_blocks: int = 0
    alive: bool = True  # False once its actor died or it is draining: never chosen

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "queued_prefill_tokens", "free_blocks", "total_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.free_blocks > self.total_blocks:
            raise ValueError(f"free_blocks ({self.free_blocks}) must be at most total_blocks ({self.total_blocks})")


class PrefillChoice(NamedTuple):
    worker_id: str
    node_id: str  # for choose_decode's same-node preference
    cached_blocks: int  # leading prompt blocks the worker's prefix cache holds (per the index)
    cost: int  # tokens to compute before this prompt is done: uncached prompt tokens + its queue


def usable_prefix_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most full blocks a prompt can take from a prefix cache: its last token is always computed, since its
    logits give the first output token (the engine's scheduler matches only these)."""
    return (num_prompt_tokens - 1) // block_size


def choose_prefill(hashes: Sequence[BlockHash], workers: Sequence[WorkerLoad], index: PrefixIndex,
                   block_size: int, num_prompt_tokens: int) -> PrefillChoice | None:
    """The live prefill (or colocated) worker with the lowest cost (module docstring); None if none is alive.

    `hashes` are the chained hashes of the prompt's full blocks (`protocol.block_hash.hash_blocks`).
    """
    assert num_prompt_tokens >= 1, "empty prompt reached placement"
    assert len(hashes) <= num_prompt_tokens // block_size, "more block hashes than full prompt blocks"
    candidates = [w for w in workers if w.alive and w.pool.prefills]
    if not candidates:
        return None
    matched = index.match_all(hashes[:usable_prefix_blocks(num_prompt_tokens, block_size)])

    def choice(w: WorkerLoad) -> PrefillChoice:
        cached = matched.get(w.worker_id, 0)
        cost = num_prompt_tokens - cached * block_size + w.queued_prefill_tokens
        return PrefillChoice(w.worker_id, w.node_id, cached, cost)

    by_worker = {w.worker_id: w for w in candidates}
    return min((choice(w) for w in candidates),
               key=lambda c: (c.cost, by_worker[c.worker_id].num_running, c.worker_id))


class RoundRobinPrefill:
    """The baseline policy for benchmarks: live prefill workers in turn (by worker id), blind to prefixes
    and load. Called like `choose_prefill`; still reports the cached blocks the chosen worker holds."""

    def __init__(self) -> None:
        self.counter = 0

    def __call__(self, hashes: Sequence[BlockHash], workers: Sequence[WorkerLoad], index: PrefixIndex,
                 block_size: int, num_prompt_tokens: int) -> PrefillChoice | None:
        candidates = sorted((w for w in workers if w.alive and w.pool.prefills), key=lambda w: w.worker_id)
        if not candidates:
            return None
        w = candidates[self.counter % len(candidates)]
        self.counter += 1
        cached = index.match(w.worker_id, hashes[:usable_prefix_blocks(num_prompt_tokens, block_size)])
        return PrefillChoice(w.worker_id, w.node_id, cached,
                             num_prompt_tokens - cached * block_size + w.queued_prefill_tokens)


def choose_decode(prefill_node: str, blocks_needed: int, workers: Sequence[WorkerLoad],
                  prefill_worker: str | None = None) -> str | None:
    """The decode worker for a request prefilled on `prefill_node`, or None when no live one has
    `blocks_needed` free blocks.

    Preference: the prefill worker itself when it is colocated (`prefill_worker`) and has room (no transfer
    at all); then a worker on `prefill_node`; then any. Within a tier the most free blocks wins, ties to
    fewest running sequences, then the smallest worker id.
    """
    assert blocks_needed >= 0, f"blocks_needed must be >= 0, got {blocks_needed}"
    roomy = [w for w in workers if w.alive and w.pool.decodes and w.free_blocks >= blocks_needed]
    if not roomy:
        return None
    for w in roomy:
        if w.worker_id == prefill_worker and w.pool is PoolKind.COLOCATED:
            return w.worker_id
    same_node = [w for w in roomy if w.node_id == prefill_node]
    best = min(same_node or roomy, key=lambda w: (-w.free_blocks, w.num_running, w.worker_id))
    return best.worker_id


NEAR_TIE = 0.10  # estimates within this fraction of the best count as equal (see `choose_path`)


class PathChoice(NamedTuple):
    path: Path
    prefill: str | None  # the prefill worker (None: local)
    decode: str
    estimate_s: float  # the cost model's estimate of the time until the request decodes
    prefill_cached_blocks: int  # prompt blocks the prefill worker (local: the decode worker) has cached


def choose_path(hashes: Sequence[BlockHash], num_prompt_tokens: int, block_size: int,
                prefills: Sequence[WorkerLoad], decodes: Sequence[WorkerLoad], index: PrefixIndex,
                cost: CostModel, blocks_needed: int, local: bool = True,
                local_chunk_tokens: int = 0) -> list[PathChoice]:
    """Every feasible placement of a prompt, cheapest first, by the cost model's estimate of the time until
    it decodes:

        remote (P, D): prefill on P (its queue + the prompt tokens P has not cached)
                       + ship the KV D has not cached over the P -> D link (measured per pair)
                       + one decode step of D
        local (D):     prefill on D itself (its queue + the tokens D has not cached), in chunks of at most
                       `local_chunk_tokens` (0: one), each riding one of D's decode steps

    A local prefill stalls D's running streams for as long as each chunk computes, so it is offered only
    when that stall is at most one of D's decode steps (a short uncached part, or D's chunk cap:
    `CostModel.local_budget_tokens`), or when the stall summed over D's steps and running streams is less
    than the time it saves this request against its best remote option (a prefill pool backed up behind
    long prompts). Both sides of that trade are measured, so the threshold moves with the hardware and the
    load, not with a constant.

    Only decode workers with `blocks_needed` free blocks are feasible; none: an empty list (the router
    queues the request). Ties go to the local path, then to fewer running sequences, then to worker ids.
    """
    usable = hashes[:usable_prefix_blocks(num_prompt_tokens, block_size)]
    matched = index.match_all(usable)
    options: list[tuple[tuple, PathChoice]] = []
    for d in decodes:
        if not (d.alive and d.pool.decodes and d.free_blocks >= blocks_needed):
            continue
        on_d = matched.get(d.worker_id, 0)
        uncached_on_d = num_prompt_tokens - on_d * block_size
        admit = cost.step_time(d.worker_id, d.num_running + 1)  # its step once this request joins
        best_remote = float("inf")
        for p in prefills:
            if not (p.alive and p.pool.prefills):
                continue
            on_p = matched.get(p.worker_id, 0)
            est = (cost.prefill_s(p.worker_id, p.queued_prefill_tokens, num_prompt_tokens - on_p * block_size)
                   + cost.transfer_s(p.worker_id, d.worker_id, p.node_id == d.node_id, uncached_on_d) + admit)
            best_remote = min(best_remote, est)
            options.append(((est, 1, p.num_running + d.num_running, p.worker_id, d.worker_id),
                            PathChoice(Path.REMOTE, p.worker_id, d.worker_id, est, on_p)))
        if not local:
            continue
        chunk = min(uncached_on_d, local_chunk_tokens or uncached_on_d)
        steps = -(-uncached_on_d // max(1, chunk))
        stall = cost.prefill_s(d.worker_id, 0, chunk)  # on each of D's next `steps` steps
        est = cost.prefill_s(d.worker_id, d.queued_prefill_tokens, uncached_on_d) + steps * admit
        if stall <= admit or stall * steps * max(1, d.num_running) < best_remote - est:
            options.append(((est, 0, d.num_running, "", d.worker_id),
                            PathChoice(Path.LOCAL, None, d.worker_id, est, on_d)))
    ranked = [choice for _, choice in sorted(options, key=lambda o: o[0])]
    if not ranked:
        return ranked
    # NOTE: estimates this close are within what the measurements scatter (a first prefill's warm-up, a
    # neighbour on a shared core): among them the option whose worker caches more of the prompt goes first,
    # so prefix affinity is not lost to noise (and the cache is not duplicated on a second worker), then the
    # decode worker running fewer sequences (a worker just scaled out, priced as its fastest peer until it
    # has steps of its own, ties with that one and must take a share of the load to be measured)
    running = {d.worker_id: d.num_running for d in decodes}
    near = [c for c in ranked if c.estimate_s <= ranked[0].estimate_s * (1 + NEAR_TIE)]
    return sorted(near, key=lambda c: (-c.prefill_cached_blocks, running[c.decode])) + ranked[len(near):]
