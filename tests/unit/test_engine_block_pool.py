"""The block allocator and prefix cache: counts stay exact under any operation sequence."""

from __future__ import annotations

import hashlib
import struct

import pytest
from fuzz_profiles import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from splitserve.prefix_hash import block_hashes, hash_block
from splitserve_worker.engine.block_pool import BlockPool
from splitserve_worker.engine.errors import NoCapacity
from splitserve_worker.engine.prefix_cache import EventKind

pytestmark = pytest.mark.unit


def test_allocate_and_free_restore_the_free_count() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert pool.free_blocks == 5 and pool.used_blocks == 3
    b = pool.allocate(5)
    assert pool.free_blocks == 0
    with pytest.raises(NoCapacity, match="need 1 KV blocks, 0 free of 8"):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    assert pool.free_blocks == 8
    pool.check_invariants()


def test_allocation_is_ascending_even_after_tail_first_frees() -> None:
    # sequences free their blocks tail first; handing them out again in that order
    # would make every transfer of the next sequence's KV a list of one-block pieces
    pool = BlockPool(16)
    a = pool.allocate(6)
    b = pool.allocate(6)
    pool.free(reversed(a))
    pool.free(reversed(b))
    got = pool.allocate(10)
    assert got == sorted(got) and len(set(got)) == 10
    assert got == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15]
    pool.check_invariants()


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_cached_blocks_count_as_free_and_are_reused_by_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    hashes = block_hashes(list(range(32)), 16)
    assert pool.register(blocks[0], hashes[0]) and pool.register(blocks[1], hashes[1])
    pool.free(reversed(blocks))
    assert pool.free_blocks == 4 and pool.cached_blocks == 2
    hit = pool.lookup(hashes)
    assert hit == blocks
    pool.touch(hit)
    assert pool.free_blocks == 2 and pool.refcount(blocks[0]) == 1
    pool.touch(hit[:1])
    assert pool.refcount(blocks[0]) == 2
    pool.free(hit)
    pool.free(hit[:1])
    assert pool.free_blocks == 4
    pool.check_invariants()


def test_eviction_is_lru_and_emits_events() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i)
    pool.free([blocks[2]])  # least recently used
    pool.free([blocks[0]])
    stored = pool.drain_events()
    assert [e.kind for e in stored] == [EventKind.STORED] * 3
    assert pool.drain_events() == []
    (got,) = pool.allocate(1)
    assert got == blocks[2]
    (ev,) = pool.drain_events()
    assert ev.kind is EventKind.EVICTED and ev.block_hashes == (102,)
    assert pool.lookup([102]) == [] and pool.lookup([100]) == [blocks[0]]
    pool.check_invariants()


def test_duplicate_content_is_not_cached_twice() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, 7)
    assert not pool.register(b, 7)
    pool.free([a, b])
    assert pool.cached_blocks == 1 and pool.free_blocks == 2
    pool.check_invariants()


def test_block_hashes_are_chained_and_skip_partial_blocks() -> None:
    toks = list(range(50))
    hs = block_hashes(toks, 16)
    assert len(hs) == 3
    assert hs[0] == hash_block(0, toks[:16])
    assert hs[1] == hash_block(hs[0], toks[16:32])
    # same block content after a different prefix hashes differently
    other = block_hashes([9, *toks[1:]], 16)
    assert other[1] != hs[1]
    # resuming from a parent gives the same result
    assert block_hashes(toks[:48], 16, parent=hs[0], start=16) == hs[1:]
    assert all(0 <= h < 2**64 for h in hs)


def test_the_block_hash_is_the_contracts_blake2b_64_pinned() -> None:
    # the router and workers of another release must agree: the hash is blake2b with an
    # 8-byte digest over the parent (u64, little-endian) then the ids (i64, little-endian),
    # read as a little-endian u64; pinned as well, so a change is a deliberate one
    toks = list(range(16))
    raw = struct.pack("<Q", 0) + struct.pack("<16q", *toks)
    expected = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    assert hash_block(0, toks) == expected == 15419130808853295947
    assert block_hashes(list(range(32)), 16)[1] == 13931401434043050494


@pytest.mark.parametrize("tail", [0, 1, 15])
def test_only_full_blocks_are_hashed_whatever_the_tail(tail: int) -> None:
    toks = list(range(32 + tail))
    assert len(block_hashes(toks, 16)) == 2
    assert len(block_hashes(toks, 16, parent=7, start=16)) == 1
    assert block_hashes(toks[:15], 16) == []


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 4)),
        st.tuples(st.just("free"), st.integers(0, 20)),
        st.tuples(st.just("register"), st.integers(0, 20), st.integers(0, 6)),
        st.tuples(st.just("hit"), st.integers(0, 6)),
    ),
    max_size=60,
)


@settings(max_examples=scaled(150), deadline=None)
@given(ops)
def test_random_operations_keep_counts_exact(seq: list[tuple]) -> None:
    pool = BlockPool(10)
    owned: list[list[int]] = []
    for op in seq:
        if op[0] == "alloc":
            if op[1] <= pool.free_blocks:
                owned.append(pool.allocate(op[1]))
            else:
                with pytest.raises(NoCapacity):
                    pool.allocate(op[1])
        elif op[0] == "free" and owned:
            pool.free(reversed(owned.pop(op[1] % len(owned))))
        elif op[0] == "register" and owned:
            blocks = owned[op[1] % len(owned)]
            pool.register(blocks[0], op[2])
        elif op[0] == "hit":
            hit = pool.lookup([op[1]])
            if hit:
                pool.touch(hit)
                owned.append(hit)
        pool.check_invariants()
        in_use = {b for o in owned for b in o}
        assert pool.used_blocks == len(in_use)
    for o in owned:
        pool.free(o)
    assert pool.free_blocks == pool.total_blocks
    pool.check_invariants()
