"""Conversation sessions' records in Redis (shared.state.sessions): the moves of the table, their fences, the owner's
limit, the stale-turn takeover and closing, each one script against a real Redis."""

from __future__ import annotations

import pytest

from shared.wire.events import SessionReason, SessionState as S
from shared.state.sessions import (
    ALLOWED,
    Move,
    Moved,
    SessionStore,
    begin_turn,
    close,
    end_turn,
    open_session,
    pause,
    released,
    swapped,
)


@pytest.fixture
def store(redis_client, names):
    return SessionStore(redis_client, names, ttl_s=60)


def state(store, key) -> str | None:
    raw = store.r.hget(key, "state")
    return raw.decode() if raw else None


def test_a_first_turn_creates_the_session_running(store):
    key = store.key("k1", "chat-1")
    res = store.move(begin_turn(key, "r1", limit=10))
    assert res.applied and res.state is S.OPEN
    assert state(store, key) == "RUNNING"
    assert store.r.hget(key, "turns") == b"1" and store.r.hget(key, "current") == b"r1"
    assert 0 < store.r.ttl(key) <= 60


def test_a_second_turn_while_one_runs_is_refused_and_changes_nothing(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    res = store.move(begin_turn(key, "r2", limit=10))
    assert res.status is Moved.REFUSED and res.current == "r1"
    assert store.r.hget(key, "current") == b"r1" and store.r.hget(key, "turns") == b"1"


def test_the_worker_pauses_the_turn_it_finished_and_the_next_turn_learns_where_the_kv_is(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    assert store.move(pause(key, "r1", "w1", blocks=12)).applied
    assert state(store, key) == "PAUSED" and store.r.hget(key, "kv_blocks") == b"12"
    res = store.move(begin_turn(key, "r2", limit=10))
    assert res.applied and res.state is S.PAUSED and res.worker == "w1"


def test_a_pause_for_an_older_turn_is_fenced(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    store.move(end_turn(key, "r1"))
    store.move(begin_turn(key, "r2", limit=10))
    res = store.move(pause(key, "r1", "w1", blocks=12))
    assert res.status is Moved.FENCED
    assert state(store, key) == "RUNNING" and store.r.hget(key, "current") == b"r2"


def test_a_worker_cannot_swap_or_release_a_session_another_worker_holds(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    store.move(pause(key, "r1", "w1", blocks=4))
    assert store.move(swapped(key, "r1", "w2")).status is Moved.FENCED
    assert store.move(released(key, "r1", "w2", SessionReason.IDLE)).status is Moved.FENCED
    assert store.move(swapped(key, "r1", "w1")).applied
    assert state(store, key) == "SWAPPED" and store.r.hget(key, "tier") == b"disk"
    assert store.move(released(key, "r1", "w1", SessionReason.IDLE)).applied
    assert state(store, key) == "OPEN" and store.r.hget(key, "worker") == b""
    assert store.r.hget(key, "reason") == b"idle"


def test_a_turn_over_one_whose_request_ended_unclosed_takes_it_over_only_if_it_is_still_that_one(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    assert store.move(begin_turn(key, "r3", limit=10, over_stale="r0")).status is Moved.FENCED
    res = store.move(begin_turn(key, "r2", limit=10, over_stale="r1"))
    assert res.applied and store.r.hget(key, "current") == b"r2"
    assert store.r.hget(key, "reason") == b"stale_turn"


def test_an_owner_past_its_session_limit_gets_limit_and_nothing_is_created(store):
    for i in range(3):
        assert store.move(begin_turn(store.key("k1", f"s{i}"), f"r{i}", limit=3)).applied
    res = store.move(begin_turn(store.key("k1", "s9"), "r9", limit=3))
    assert res.status is Moved.LIMIT and res.count == 3
    assert not store.r.exists(store.key("k1", "s9"))
    assert store.move(begin_turn(store.key("k2", "s9"), "r9", limit=3)).applied  # another key's own limit


def test_two_keys_sessions_of_one_id_are_two_sessions(store):
    a, b = store.key("k1", "same"), store.key("k2", "same")
    store.move(begin_turn(a, "r1", limit=10))
    assert store.move(begin_turn(b, "r2", limit=10)).applied
    assert a != b and store.r.hget(b, "current") == b"r2"


def test_closing_deletes_the_record_and_names_the_worker_holding_the_kv(store):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    store.move(pause(key, "r1", "w1", blocks=4))
    res = store.move(close(key))
    assert res.applied and res.worker == "w1"
    assert not store.r.exists(key)
    assert store.r.zscore(store.names.sessions_index("k1"), "chat-1") is None
    assert store.move(close(key)).status is Moved.MISSING


def test_opening_an_existing_session_is_refused(store):
    key = store.key("k1", "chat-1")
    assert store.move(open_session(key, 10)).applied
    assert state(store, key) == "OPEN"
    assert store.move(open_session(key, 10)).status is Moved.REFUSED


def test_a_move_the_table_does_not_allow_is_refused_before_it_reaches_redis():
    assert S.PAUSED not in ALLOWED[S.OPEN]
    with pytest.raises(ValueError):
        Move("ns:{sess:k}:s:x", S.PAUSED, SessionReason.TURN, only_from=(S.OPEN,)).args(60)


def test_a_move_of_a_session_never_opened_finds_it_missing(store):
    assert store.move(pause(store.key("k1", "nope"), "r1", "w1", 3)).status is Moved.MISSING


def _session_feed(client, names) -> list:
    from shared.state.lifecycle_feed import decode_record

    records = [decode_record(i, f) for p in names.all_partitions for i, f in client.xrange(names.lifecycle_feed(p))]
    return sorted((r for r in records if r.session), key=lambda r: r.id)


def test_every_applied_session_move_is_one_lifecycle_feed_record_in_its_turns_partition(redis_client):
    from shared.wire.constants import Names

    names = Names("tfeed", partitions=4)
    store = SessionStore(redis_client, names, ttl_s=60)
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    store.move(pause(key, "r1", "w1", blocks=3))
    store.move(swapped(key, "r1", "w1"))
    store.move(close(key))
    feed = _session_feed(redis_client, names)
    assert [(r.from_, r.to, r.reason) for r in feed] == [
        ("OPEN", "RUNNING", "turn"),
        ("RUNNING", "PAUSED", "turn"),
        ("PAUSED", "SWAPPED", "pressure"),
        ("SWAPPED", "CLOSED", "client_close"),
    ]
    assert {(r.rid, r.session, r.owner) for r in feed} == {("r1", "chat-1", "k1")}
    assert [r.worker for r in feed] == ["", "w1", "w1", ""]
    # In the feed partition of the turn's request: beside that request's own transitions, in order.
    assert all(
        redis_client.xlen(names.lifecycle_feed(p)) == 0 for p in names.all_partitions if p != names.partition("r1")
    )
    assert [r.at for r in feed] == sorted(r.at for r in feed) and feed[0].at > 0


def test_a_session_move_refused_or_fenced_appends_no_feed_record(store, names):
    key = store.key("k1", "chat-1")
    store.move(begin_turn(key, "r1", limit=10))
    store.move(begin_turn(key, "r2", limit=10))  # refused: r1 runs
    store.move(pause(key, "r0", "w1", blocks=3))  # fenced: not its turn
    assert [r.to for r in _session_feed(store.r, names)] == ["RUNNING"]


def test_an_async_session_move_records_itself_in_the_feed_too(redis_server, redis_client, names):
    import asyncio

    import redis.asyncio as aioredis

    async def open_one():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            store = SessionStore(client, names, ttl_s=60)
            return await store.amove(open_session(store.key("", "s-9"), limit=10))
        finally:
            await client.aclose()

    assert asyncio.run(open_one()).applied
    feed = _session_feed(redis_client, names)
    assert [(r.rid, r.from_, r.to, r.session, r.owner, r.service) for r in feed] == [
        ("", "", "OPEN", "s-9", "", "gateway")
    ]
