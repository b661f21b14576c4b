"""Placement: prefix affinity traded against load for prefill; same node, then free blocks, for decode."""

from __future__ import annotations

import pytest

from protocol import PoolKind
from protocol.block_hash import hash_blocks
from router.placement import PrefillChoice, RoundRobinPrefill, WorkerLoad, choose_decode, choose_prefill
from router.prefix_index import PrefixIndex

BS = 16
PROMPT = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks + 5 tokens
HASHES = hash_blocks(PROMPT, BS)


def prefill(worker_id: str, node: str = "n0", **load) -> WorkerLoad:
    return WorkerLoad(worker_id, node, PoolKind.PREFILL, **load)


def decode(worker_id: str, node: str = "n0", free: int = 100, **load) -> WorkerLoad:
    return WorkerLoad(worker_id, node, PoolKind.DECODE, free_blocks=free, total_blocks=max(free, 100), **load)


def index_with(**cached_blocks: int) -> PrefixIndex:
    index = PrefixIndex()
    for worker, n in cached_blocks.items():
        index.apply(worker, HASHES[:n], [])
    return index


def pick(workers, index, prompt=PROMPT) -> PrefillChoice | None:
    return choose_prefill(hash_blocks(prompt, BS), workers, index, BS, len(prompt))


# --- prefill ----------------------------------------------------------------------------------------------


def test_prefers_the_worker_holding_the_prefix() -> None:
    choice = pick([prefill("a"), prefill("b"), prefill("c")], index_with(a=2, b=8, c=5))
    assert choice == PrefillChoice("b", "n0", 8, len(PROMPT) - 8 * BS)


def test_an_idle_worker_beats_a_long_queue_when_the_prefix_is_small() -> None:
    # a saves 2 blocks (32 tokens) but has 500 tokens queued; b starts at once
    choice = pick([prefill("a", queued_prefill_tokens=500), prefill("b")], index_with(a=2))
    assert choice.worker_id == "b" and choice.cached_blocks == 0


def test_a_long_prefix_beats_a_short_queue() -> None:
    # a saves 10 blocks (160 tokens) and has 100 queued: 5 + 100 < 165 + 0
    choice = pick([prefill("a", queued_prefill_tokens=100), prefill("b")], index_with(a=10))
    assert (choice.worker_id, choice.cost) == ("a", 5 + 100)


def test_the_trade_off_is_exactly_cached_tokens_against_queued_tokens() -> None:
    # a saves 4 blocks = 64 tokens; with 64 queued it ties with idle b, with 65 it loses
    tie = pick([prefill("a", queued_prefill_tokens=64, num_running=1), prefill("b", num_running=2)],
               index_with(a=4))
    assert tie.worker_id == "a"  # equal cost: fewer running wins
    worse = pick([prefill("a", queued_prefill_tokens=65), prefill("b")], index_with(a=4))
    assert worse.worker_id == "b"


def test_ties_go_to_fewest_running_then_smallest_id() -> None:
    index = PrefixIndex()
    assert pick([prefill("b", num_running=3), prefill("c", num_running=1), prefill("a", num_running=2)],
                index).worker_id == "c"
    assert pick([prefill("b"), prefill("a")], index).worker_id == "a"


def test_dead_workers_and_decode_workers_are_never_chosen_for_prefill() -> None:
    index = index_with(a=10, d=10)
    workers = [prefill("a", alive=False), decode("d"), prefill("b", node="n1", queued_prefill_tokens=10_000)]
    choice = pick(workers, index)
    assert (choice.worker_id, choice.node_id) == ("b", "n1")


def test_colocated_workers_prefill() -> None:
    worker = WorkerLoad("c", "n0", PoolKind.COLOCATED)
    assert pick([worker], index_with(c=3)) == PrefillChoice("c", "n0", 3, len(PROMPT) - 3 * BS)


def test_no_live_prefill_worker_is_none() -> None:
    assert pick([], PrefixIndex()) is None
    assert pick([prefill("a", alive=False), decode("d")], PrefixIndex()) is None


def test_the_last_prompt_token_is_always_computed() -> None:
    prompt = PROMPT[:3 * BS]  # exactly 3 full blocks, all cached
    choice = pick([prefill("a")], index_with(a=3), prompt)
    assert (choice.cached_blocks, choice.cost) == (2, BS)


def test_short_prompt_has_nothing_to_reuse() -> None:
    assert pick([prefill("a")], index_with(a=1), PROMPT[:5]) == PrefillChoice("a", "n0", 0, 5)


def test_round_robin_cycles_live_prefill_workers_in_id_order() -> None:
    policy = RoundRobinPrefill()
    workers = [prefill("c"), prefill("a"), prefill("x", alive=False), decode("d"), prefill("b")]
    index = index_with(b=4)
    hashes = hash_blocks(PROMPT, BS)
    chosen = [policy(hashes, workers, index, BS, len(PROMPT)) for _ in range(4)]
    assert [c.worker_id for c in chosen] == ["a", "b", "c", "a"]
    assert chosen[1].cached_blocks == 4  # blind to the prefix, but reports it
    assert RoundRobinPrefill()(hashes, [decode("d")], index, BS, len(PROMPT)) is None


# --- decode -----------------------------------------------------------------------------------------------


def test_same_node_is_preferred_even_with_fewer_free_blocks() -> None:
    workers = [decode("far", node="n1", free=90), decode("near", node="n0", free=20)]
    assert choose_decode("n0", 10, workers) == "near"


def test_among_same_node_workers_most_free_blocks_wins() -> None:
    workers = [decode("d1", free=20), decode("d2", free=50), decode("d3", node="n1", free=99)]
    assert choose_decode("n0", 10, workers) == "d2"


def test_falls_back_to_most_free_blocks_when_the_node_is_full() -> None:
    workers = [decode("near", node="n0", free=9), decode("d1", node="n1", free=30),
               decode("d2", node="n2", free=60)]
    assert choose_decode("n0", 10, workers) == "d2"


def test_room_means_at_least_blocks_needed() -> None:
    assert choose_decode("n0", 10, [decode("d", free=10)]) == "d"
    assert choose_decode("n0", 11, [decode("d", free=10)]) is None


def test_none_when_no_decode_worker_has_room() -> None:
    workers = [decode("d1", free=3), decode("d2", node="n1", free=5), decode("dead", free=100, alive=False),
               prefill("p")]
    assert choose_decode("n0", 6, workers) is None
    assert choose_decode("n0", 1, []) is None


def test_decode_ties_go_to_fewest_running_then_smallest_id() -> None:
    assert choose_decode("n0", 1, [decode("a", num_running=5), decode("b", num_running=2)]) == "b"
    assert choose_decode("n0", 1, [decode("b"), decode("a")]) == "a"


def test_a_colocated_prefill_worker_decodes_its_own_request_when_it_has_room() -> None:
    colocated = WorkerLoad("c", "n0", PoolKind.COLOCATED, free_blocks=10, total_blocks=100)
    workers = [colocated, decode("d", free=90)]
    assert choose_decode("n0", 5, workers, prefill_worker="c") == "c"
    assert choose_decode("n0", 11, workers, prefill_worker="c") == "d"
    assert choose_decode("n0", 5, workers) == "d"  # otherwise it is one more decode candidate


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_running": -1}, "num_running"),
    ({"queued_prefill_tokens": -5}, "queued_prefill_tokens"),
    ({"free_blocks": 11, "total_blocks": 10}, "free_blocks"),
])
def test_worker_load_rejects_impossible_snapshots(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        WorkerLoad("w", "n", PoolKind.DECODE, **kwargs)
