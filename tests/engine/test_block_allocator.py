"""Allocator invariants under random allocate/free/fork/cache/evict sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_allocator import BlockAllocator
from protocol.block_hash import hash_block, hash_blocks


def test_lru_eviction_takes_least_recently_freed_and_tail_blocks_first():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    for i, b in enumerate(blocks):
        a.cache_block(b, 100 + i)
    a.free(blocks)
    got = a.allocate(2)  # the untouched block 3, then the sequence's tail block
    assert got == [3, blocks[2]]
    assert a.find_cached([100, 101, 102]) == blocks[:2]
    assert a.changes_since(3).removed == [102]


def test_touch_revives_a_cached_free_block():
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    a.cache_block(b, 7)
    a.free([b])
    assert a.num_free_blocks == 2 and a.find_cached([7]) == [b]
    a.touch([b])
    assert a.num_free_blocks == 1 and a.ref_counts[b] == 1
    assert a.allocate(2) is None  # out of room is a normal return, and changes nothing
    assert a.num_free_blocks == 1


def test_chained_hash_depends_on_every_earlier_token():
    a = hash_blocks(list(range(32)), 16)
    b = hash_blocks([99] + list(range(1, 32)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert a[1] == hash_block(a[0], list(range(16, 32)))
    assert hash_blocks(list(range(31)), 16) == a[:1]  # partial blocks are not hashed


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "fork", "cache", "lookup"]),
                         st.integers(0, 6), st.integers(0, 50)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_operation_sequences_keep_invariants(seq):
    a = BlockAllocator(12)
    owners: list[list[int]] = []  # each owner holds one reference to each of its blocks
    for op, n, key in seq:
        if op == "alloc":
            got = a.allocate(n)
            if got is None:
                assert n > a.num_free_blocks
            else:
                assert len(set(got)) == n
                owners.append(got)
        elif op == "free" and owners:
            a.free(owners.pop(key % len(owners)))
        elif op == "fork" and owners:
            owners.append(list(owners[key % len(owners)]))
            a.fork(owners[-1])
        elif op == "cache" and owners and owners[key % len(owners)]:
            blocks = owners[key % len(owners)]
            a.cache_block(blocks[key % len(blocks)], key)
        elif op == "lookup":
            found = a.find_cached(list(range(key, key + n)))
            a.touch(found)
            owners.append(found)
        a.check_invariants()
        held = {b for o in owners for b in o}
        assert a.num_used_blocks == len(held)
        for b in held:
            assert a.ref_counts[b] == sum(o.count(b) for o in owners)
    for o in owners:
        a.free(o)
    a.check_invariants()
    assert a.num_free_blocks == 12
