"""PrefixIndex against the real allocator's cache events and against a plain-set model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_allocator import BlockAllocator, CacheEventLog
from protocol.block_hash import hash_blocks
from router.prefix_index import PrefixIndex


def test_match_counts_leading_hashes_and_stops_at_the_first_miss() -> None:
    index = PrefixIndex()
    index.apply("w0", stored=[1, 2, 4], removed=[])
    assert index.match("w0", [1, 2, 3, 4]) == 2  # 4 is held but comes after the gap
    assert index.match("w0", [2, 1]) == 2  # order of the probe, not of storing
    assert index.match("w0", [9, 1]) == 0
    assert index.match("w0", []) == 0
    assert index.match("unknown", [1]) == 0


def test_store_and_evict_in_one_drain_leaves_it_out_and_evict_then_store_leaves_it_in() -> None:
    index = PrefixIndex()
    index.apply("w0", stored=[7], removed=[7])  # stored then evicted before the drain
    assert index.blocks("w0") == frozenset()
    index.apply("w0", stored=[8], removed=[])
    index.apply("w0", stored=[8], removed=[8])  # evicted then stored again before the drain
    assert index.blocks("w0") == {8}
    index.apply("w0", stored=[8], removed=[8, 8])  # evicted, stored, evicted
    assert index.blocks("w0") == frozenset()


def test_a_real_allocator_re_storing_an_evicted_hash_within_one_drain() -> None:
    alloc, index = BlockAllocator(num_blocks=1), PrefixIndex()
    (block,) = alloc.allocate(1)
    alloc.cache_block(block, 42)
    alloc.free([block])
    (block,) = alloc.allocate(1)  # evicts 42
    alloc.cache_block(block, 42)  # the same prefix computed again
    events = alloc.changes_since(0)
    assert (events.stored, events.removed, events.since, events.seq) == ([42, 42], [42], 0, 3)
    assert index.apply_changes("w0", alloc.changes_since(-1)) == "resynced"  # a first read: the whole cache
    assert index.match("w0", [42]) == 1 and index.cursor("w0") == 3


def test_a_reader_applies_changes_once_in_order_and_asks_again_when_behind() -> None:
    alloc, index = BlockAllocator(num_blocks=2), PrefixIndex()
    assert index.apply_changes("w0", alloc.changes_since(-1)) == "resynced" and index.cursor("w0") == 0
    (a,) = alloc.allocate(1)
    alloc.cache_block(a, 1)
    early = alloc.changes_since(0)  # store 1
    alloc.free([a])
    alloc.allocate(2)  # evicts 1
    late = alloc.changes_since(0)  # store 1, remove 1: overlaps `early`
    assert index.apply_changes("w0", early) == "applied" and index.match("w0", [1]) == 1
    # NOTE: folding `late` in too would count its store of 1 twice: it is refused, and read from the cursor
    assert index.apply_changes("w0", late) == "behind"
    assert index.apply_changes("w0", alloc.changes_since(index.cursor("w0"))) == "applied"
    assert index.match("w0", [1]) == 0
    assert index.apply_changes("w0", early) == "stale"


def test_a_reader_the_log_no_longer_reaches_gets_the_whole_cache() -> None:
    alloc, index = BlockAllocator(num_blocks=4), PrefixIndex()
    alloc.events = CacheEventLog(capacity=2)
    index.apply_changes("w0", alloc.changes_since(-1))
    blocks = alloc.allocate(3)
    for b, h in zip(blocks, [7, 8, 9]):
        alloc.cache_block(b, h)
    changes = alloc.changes_since(index.cursor("w0"))  # 3 changes since the cursor, 2 kept
    assert changes.full and sorted(changes.stored) == [7, 8, 9]
    assert index.apply_changes("w0", changes) == "resynced"
    assert index.blocks("w0") == {7, 8, 9} and index.cursor("w0") == 3


def test_workers_are_independent_and_removing_one_forgets_it() -> None:
    index = PrefixIndex()
    index.apply("a", [1, 2, 3], [])
    index.apply("b", [1, 2], [])
    assert index.match_all([1, 2, 3]) == {"a": 3, "b": 2}
    index.apply("a", [], [2])
    assert index.match_all([1, 2, 3]) == {"a": 1, "b": 2}
    index.remove_worker("b")
    assert index.match_all([1, 2, 3]) == {"a": 1}
    assert index.workers == ["a"] and index.num_blocks("b") == 0
    index.remove_worker("a")
    index.remove_worker("never-seen")
    assert index.match_all([1]) == {}
    assert index._holders == {}  # nothing left behind for departed workers


def test_long_prompt_many_workers() -> None:
    hashes = hash_blocks(list(range(16 * 4096)), 16)
    index = PrefixIndex()
    for w in range(200):
        index.apply(f"w{w}", hashes[:w * 20], [])
    matched = index.match_all(hashes)
    assert matched == {f"w{w}": w * 20 for w in range(1, 200)}
    assert index.match("w199", hashes) == 3980


def model_match(blocks: set[int], hashes: list[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n


# A random life of several workers' allocators: sequences take blocks, cache them under hashes drawn from a
# small pool (so the same prefix recurs across workers and over time), free them, get evicted by later
# allocations, reset; each worker's events are drained at random moments and folded into the index.
# NOTE: few blocks and few hashes, so that evictions and re-stores of the same hash within one drain are
# common; allocs and frees outnumber the rarer drains, resets and departures.
WORKERS = ["w0", "w1"]
NUM_BLOCKS = 4
HASHES = st.integers(0, 5)
op = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from(WORKERS), st.lists(HASHES, min_size=1, max_size=3)),
    st.tuples(st.just("free"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("alloc"), st.sampled_from(WORKERS), st.lists(HASHES, min_size=1, max_size=3)),
    st.tuples(st.just("free"), st.sampled_from(WORKERS), st.integers(0, 3)),
    st.tuples(st.just("read"), st.sampled_from(WORKERS), st.sampled_from([0, 1])),
    st.tuples(st.just("reset"), st.sampled_from(WORKERS), st.none()),
    st.tuples(st.just("leave"), st.sampled_from(WORKERS), st.none()),
)


@settings(max_examples=300, deadline=None, database=None)
@given(ops=st.lists(op, max_size=80), probe=st.lists(HASHES, max_size=6))
def test_indexes_reading_at_their_own_pace_track_real_allocators(ops, probe: list[int]) -> None:
    """Two router replicas' indexes read the same workers' logs, each from its own cursor; the logs keep few
    changes, so a reader that lags is resynced from a full snapshot."""

    def fresh() -> BlockAllocator:
        alloc = BlockAllocator(num_blocks=NUM_BLOCKS)
        alloc.events = CacheEventLog(capacity=6)
        return alloc

    def read(index: PrefixIndex, w: str) -> None:
        changes = allocators[w].changes_since(index.cursor(w))
        assert index.apply_changes(w, changes) in ("applied", "resynced", "stale")

    allocators = {w: fresh() for w in WORKERS}
    seqs: dict[str, list[list[int]]] = {w: [] for w in WORKERS}
    indexes = [PrefixIndex(), PrefixIndex()]
    for kind, w, arg in ops:
        alloc = allocators[w]
        if kind == "alloc":
            blocks = alloc.allocate(len(arg))
            if blocks is not None:
                for block, h in zip(blocks, arg):
                    alloc.cache_block(block, h)
                seqs[w].append(blocks)
        elif kind == "free" and seqs[w]:
            alloc.free(seqs[w].pop(arg % len(seqs[w])))
        elif kind == "reset":
            alloc.reset_cache()
        elif kind == "read":
            read(indexes[arg], w)
        elif kind == "leave":  # the worker is replaced by a fresh one with an empty cache
            for index in indexes:
                index.remove_worker(w)
            allocators[w], seqs[w] = fresh(), []
    expected = {w: model_match(set(a.cached), probe) for w, a in allocators.items()}
    for index in indexes:
        for w, alloc in allocators.items():
            read(index, w)
            assert index.blocks(w) == set(alloc.cached)
            assert index.match(w, probe) == model_match(set(alloc.cached), probe)
        assert index.match_all(probe) == {w: n for w, n in expected.items() if n > 0}


@settings(max_examples=150, deadline=None, database=None)
@given(drains=st.lists(st.tuples(st.sampled_from(WORKERS), st.lists(st.tuples(st.booleans(), HASHES),
                                                                    max_size=10)), max_size=20),
       probes=st.lists(st.lists(HASHES, max_size=6), min_size=1, max_size=4))
def test_index_equals_a_set_model(drains, probes) -> None:
    """Any alternating store/remove history per hash, batched into drains, lands on the model's sets."""
    model: dict[str, set[int]] = {w: set() for w in WORKERS}
    index = PrefixIndex()
    for w, toggles in drains:
        stored, removed = [], []
        for store, h in toggles:
            # the allocator never stores a cached hash nor removes an uncached one
            if store and h not in model[w]:
                model[w].add(h)
                stored.append(h)
            elif not store and h in model[w]:
                model[w].discard(h)
                removed.append(h)
        index.apply(w, stored, removed)
    for w in WORKERS:
        assert index.blocks(w) == model[w]
    for probe in probes:
        want = {w: model_match(model[w], probe) for w in WORKERS}
        assert index.match_all(probe) == {w: n for w, n in want.items() if n > 0}
