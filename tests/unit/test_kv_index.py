"""The scheduler's KV index alone (services/scheduler/kv_index.py): pure, built from KvEvents."""

from __future__ import annotations

from services.scheduler.kv_index import KvIndex
from shared.wire.block_hash import block_hashes
from shared.wire.events import KvEvents

A, B = block_hashes(list(range(64)), 16), block_hashes(list(range(100, 164)), 16)  # two prompts, 4 blocks each


def ev(worker: str, seq: int, stored=(), removed=(), cleared=False, incarnation="i1") -> KvEvents:
    return KvEvents(
        worker_id=worker,
        incarnation=incarnation,
        seq=seq,
        block_size=16,
        cleared=cleared,
        stored=tuple(stored),
        removed=tuple(removed),
    )


def test_stored_blocks_are_matched_as_a_leading_run_per_worker():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w2", 1, A[:2], cleared=True))
    assert idx.match(A) == {"w1": 4, "w2": 2}
    assert idx.match(B) == {}


def test_a_hole_ends_the_match_even_if_later_blocks_are_held():
    idx = KvIndex()
    idx.apply(ev("w1", 1, [A[0], A[2], A[3]], cleared=True))
    assert idx.match(A) == {"w1": 1}


def test_removed_blocks_are_no_longer_matched():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w1", 2, removed=A[2:]))
    assert idx.match(A) == {"w1": 2}
    assert len(idx.holders["w1"].blocks) == 2


def test_cleared_replaces_everything_the_worker_held():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w1", 2, B, cleared=True))
    assert idx.match(A) == {} and idx.match(B) == {"w1": 4}
    idx.apply(ev("w1", 3, cleared=True))
    assert idx.match(B) == {} and not idx.by_hash


def test_a_redelivered_event_changes_nothing():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w1", 2, removed=A[1:]))
    idx.apply(ev("w1", 1, A, cleared=True))  # delivered again: must not bring the removed blocks back
    idx.apply(ev("w1", 2, removed=A[1:]))
    assert idx.match(A) == {"w1": 1} and not idx.lagging


def test_a_gap_in_a_workers_events_drops_its_entries_until_it_announces_them():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w1", 3, B))  # event 2 was trimmed away before it was read
    assert idx.match(A) == {} and "w1" in idx.lagging
    idx.apply(ev("w1", 4, removed=A[:1]))  # still unknown: ignored
    assert idx.match(A) == {}
    idx.apply(ev("w1", 5, A + B, cleared=True))  # the announcement
    assert idx.match(A) == {"w1": 4} and not idx.lagging


def test_events_of_an_unannounced_incarnation_mark_the_worker_lagging():
    idx = KvIndex()
    idx.apply(ev("w1", 7, A))  # its announcement was trimmed away (a scheduler started late)
    assert idx.match(A) == {} and "w1" in idx.lagging


def test_a_heartbeat_naming_an_unseen_event_marks_the_worker_lagging():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.check_heartbeat("w1", "i1", 1)
    assert not idx.lagging
    idx.check_heartbeat("w1", "i1", 2)
    assert "w1" in idx.lagging and idx.match(A) == {}


def test_a_dead_worker_is_dropped_with_all_its_entries():
    idx = KvIndex()
    idx.apply(ev("w1", 1, A, cleared=True))
    idx.apply(ev("w2", 1, A + B, cleared=True))
    idx.drop_worker("w2")
    assert idx.match(A) == {"w1": 4} and idx.match(B) == {}
    assert all("w2" not in ws for ws in idx.by_hash.values())
