"""Block pool unit tests: chained hashes, reference counts, LRU eviction only when needed."""

from __future__ import annotations

import pytest

from services.worker.engine.kv.block_manager import BlockManager
from shared.wire.block_hash import chain_hash, extend_block_hashes


def test_hash_chain_depends_on_every_earlier_token():
    a = list(range(8))
    b = [99] + list(range(1, 8))  # differs in the first block only
    ha, hb = [], []
    extend_block_hashes(a, ha, 4, len(a))
    extend_block_hashes(b, hb, 4, len(b))
    assert len(ha) == 2
    assert ha[1] != hb[1], "second block's hash must change when an earlier block changes"
    assert ha[1] != chain_hash(None, a[4:]), "a block's hash includes its parent's"
    again = []
    extend_block_hashes(a, again, 4, len(a))
    assert again == ha, "hashes are deterministic"


def test_only_full_blocks_are_hashed_incrementally():
    hashes: list[bytes] = []
    extend_block_hashes(list(range(7)), hashes, 4, 7)
    assert len(hashes) == 1
    extend_block_hashes(list(range(9)), hashes, 4, 9)
    assert len(hashes) == 2


def test_refcount_keeps_shared_block_until_last_release():
    bm = BlockManager(4, 4, True)
    (b,) = bm.allocate(1)
    bm.register(b, b"h")
    bm.acquire([b])  # a second request shares it
    bm.release([b])
    assert bm.num_free_blocks == 3, "still referenced once"
    bm.release([b])
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 1, "unreferenced but still cached"
    bm.check_no_leak()


def test_cached_blocks_are_evicted_lru_and_only_when_room_is_needed():
    bm = BlockManager(4, 4, True)
    blocks = bm.allocate(3)
    for i, b in enumerate(blocks):
        bm.register(b, bytes([i]))
    bm.release([blocks[0]])  # oldest unreferenced
    bm.release([blocks[2]])
    bm.release([blocks[1]])
    assert bm.num_cached_blocks == 3
    (fresh,) = bm.allocate(1)  # the never-used block comes first: nothing evicted
    assert fresh not in blocks and bm.num_cached_blocks == 3
    (evicted,) = bm.allocate(1)
    assert evicted == blocks[0], "least recently released cached block goes first"
    assert bm.lookup_prefix([bytes([0])], 1) == [], "its hash is forgotten"
    assert bm.lookup_prefix([bytes([2])], 1) == [blocks[2]]


def test_lookup_stops_at_first_miss_and_respects_limit():
    bm = BlockManager(8, 4, True)
    blocks = bm.allocate(3)
    for b, h in zip(blocks, [b"a", b"b", b"c"]):
        bm.register(b, h)
    assert bm.lookup_prefix([b"a", b"x", b"c"], 3) == blocks[:1]
    assert bm.lookup_prefix([b"a", b"b", b"c"], 2) == blocks[:2]


def test_acquiring_an_evictable_hit_counts_against_free_blocks():
    bm = BlockManager(2, 4, True)
    (b,) = bm.allocate(1)
    bm.register(b, b"a")
    bm.release([b])
    assert bm.can_allocate(2)
    assert not bm.can_allocate(2, reused=[b]), "reusing the cached block leaves one free block"
    assert bm.can_allocate(1, reused=[b])


def test_duplicate_hash_keeps_first_block():
    bm = BlockManager(4, 4, True)
    b1, b2 = bm.allocate(2)
    bm.register(b1, b"same")
    bm.register(b2, b"same")
    bm.release([b1, b2])
    assert bm.num_cached_blocks == 1 and bm.lookup_prefix([b"same"], 1) == [b1]
    bm.check_no_leak()


def test_prefix_caching_disabled_caches_nothing():
    bm = BlockManager(4, 4, False)
    (b,) = bm.allocate(1)
    bm.register(b, b"a")
    assert bm.lookup_prefix([b"a"], 1) == [] and bm.num_cached_blocks == 0
    bm.release([b])
    bm.check_no_leak()


def test_check_no_leak_names_held_blocks():
    bm = BlockManager(4, 4, True)
    bm.allocate(2)
    with pytest.raises(AssertionError, match="still referenced"):
        bm.check_no_leak()


def test_a_sequences_blocks_are_handed_out_in_address_order_after_tail_first_eviction():
    """Release puts a finished sequence's blocks on the LRU tail first; the next sequence that takes them still gets
    them ascending, so its positions lie in ascending memory (what the attention kernels stream fastest)."""
    bm = BlockManager(8, 4, True)
    first = bm.allocate(8)
    for i, b in enumerate(first):
        bm.register(b, bytes([i]))
    bm.release(first)  # all cached, evictable tail first: 7, 6, ..., 0
    taken = bm.allocate(5)
    assert taken == sorted(taken)
    assert set(taken) == {7, 6, 5, 4, 3}, "which blocks are evicted is unchanged: the tail's, LRU first"
