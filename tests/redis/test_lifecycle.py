"""The lifecycle state machine: the table, the transition function, and settlement races."""

from __future__ import annotations


import pytest

from shared.state.context_store import ContextStore
from shared.state.lifecycle import ALLOWED, TERMINAL, Lifecycle, Outcome, State
from tests.support.factories import request_received

# A path through the table that reaches every non-terminal state.
PATH_TO = {
    State.RECEIVED: [],
    State.PREPROCESSED: [State.PREPROCESSED],
    State.QUEUED: [State.PREPROCESSED, State.QUEUED],
    State.SCHEDULED: [State.PREPROCESSED, State.QUEUED, State.SCHEDULED],
    State.PREFILLING: [State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING],
    State.DECODING: [State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.DECODING],
    State.PREEMPTED: [State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.PREEMPTED],
}


def _create(client, names, ttl=60):
    import asyncio

    import redis.asyncio as aioredis

    ev = request_received()
    url = client.connection_pool.connection_kwargs
    aclient = aioredis.Redis(host=url["host"], port=url["port"])
    store = ContextStore(aclient, names, ttl)
    asyncio.run(store.acreate(ev.request_id, {"priority": 0}, {"prompt": ev.prompt}, ev))
    return ev.request_id


def _at(client, names, state: State) -> tuple[Lifecycle, str]:
    lc = Lifecycle(client, names, "test", 60)
    rid = _create(client, names)
    for s in PATH_TO[state]:
        assert lc.transition(rid, s).applied
    return lc, rid


ALL_PAIRS = [(a, b) for a in State for b in State]


def test_table_covers_every_state():
    assert set(ALLOWED) == set(State)
    assert all(not ALLOWED[t] for t in TERMINAL)


@pytest.mark.parametrize("src,dst", [p for p in ALL_PAIRS if p[0] not in TERMINAL and p[1] in ALLOWED[p[0]]])
def test_allowed_transition_is_applied_and_recorded(redis_client, names, src, dst):
    lc, rid = _at(redis_client, names, src)
    res = lc.transition(rid, dst, "why")
    assert res.applied and res.previous == src
    snap = ContextStore(redis_client, names, 60).read(redis_client, rid)
    assert snap.state == dst
    last = snap.history[-1]
    assert (last["state"], last["from"], last["service"], last["reason"]) == (dst.value, src.value, "test", "why")
    assert last["t"] >= snap.history[-2]["t"]


@pytest.mark.parametrize(
    "src,dst", [p for p in ALL_PAIRS if p[0] not in TERMINAL and p[1] not in ALLOWED[p[0]] and p[0] != p[1]]
)
def test_forbidden_transition_is_refused_and_changes_nothing(redis_client, names, src, dst):
    lc, rid = _at(redis_client, names, src)
    res = lc.transition(rid, dst)
    assert (res.status, res.previous, res.applied) == (Outcome.REFUSED, src, False)
    assert ContextStore(redis_client, names, 60).read(redis_client, rid).state == src


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
def test_terminal_state_refuses_everything_and_counts_noop(redis_client, names, terminal):
    lc, rid = _at(redis_client, names, State.DECODING)
    assert lc.transition(rid, terminal).applied
    for other in State:
        res = lc.transition(rid, other)
        assert (res.status, res.previous, res.applied) == (Outcome.SETTLED, terminal, False)
    assert int(redis_client.hget(names.counters(0), "settle_noop")) == len(TERMINAL)


def test_terminal_transition_sets_ttl_on_every_layer(redis_client, names):
    lc, rid = _at(redis_client, names, State.DECODING)
    lc.ttl = 7
    lc.transition(rid, State.FINISHED)
    for key in names.request_keys(rid):
        if redis_client.exists(key):
            assert 0 < redis_client.ttl(key) <= 7


def test_transition_publishes_its_events_atomically(redis_client, names):
    from shared.wire.events import decode
    from shared.state.lifecycle import Publish

    lc, rid = _at(redis_client, names, State.PREPROCESSED)
    ev = request_received(request_id=rid)
    res = lc.transition(rid, State.QUEUED, "", [Publish("s1", ev), Publish("s2", ev)])
    assert res.applied and len(res.entry_ids) == 2
    for stream in ("s1", "s2"):
        assert decode(redis_client.xrange(stream)[0][1][b"e"]) == ev
    refused = lc.transition(rid, State.QUEUED, "", [Publish("s3", ev)])
    assert not refused.applied and redis_client.xlen("s3") == 0
