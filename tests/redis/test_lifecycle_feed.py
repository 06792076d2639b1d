"""The lifecycle change feed: one record per transition, written by the transition scripts only."""

from __future__ import annotations

import pytest

from shared.wire.constants import LIFECYCLE_FEED_MAXLEN
from shared.state.context_store import ContextStore, WaitingBounds
from shared.state.lifecycle import Lifecycle, Outcome, Owner, State
from shared.state.lifecycle_feed import decode_record
from tests.support.factories import request_received

PATH = [State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.DECODING, State.FINISHED]


def _create(client, names, owner: str = "", bounds: WaitingBounds | None = None) -> str:
    """Create a request through the real creating script (on a sync client), as the gateway does."""
    ev = request_received()
    store = ContextStore(client, names, 60)
    keys, argv = store.create_args(ev.request_id, {"priority": 0, "owner": owner}, {"prompt": ev.prompt}, ev, bounds)
    status = store._create(keys=keys, args=argv)[0]
    return ev.request_id if status == b"ok" else status.decode()


def _feed(client, names):
    return [decode_record(i, f) for i, f in client.xrange(names.lifecycle_feed(0))]


def test_every_transition_appends_one_feed_record_with_its_fields(redis_client, names):
    rid = _create(redis_client, names, owner="key1")
    lc = Lifecycle(redis_client, names, "test", 60)
    for to in PATH:
        owner = Owner("worker-a", 1) if to == State.SCHEDULED else None
        assert lc.transition(rid, to, f"why-{to.value}", owner=owner).applied
    feed = _feed(redis_client, names)
    history = ContextStore(redis_client, names, 60).read(redis_client, rid).history
    assert len(feed) == len(history) == 1 + len(PATH)
    # The feed says what the request's own history says, in the same order (the history keeps 14 digits: cjson).
    for rec, h in zip(feed, history):
        assert (rec.rid, rec.from_, rec.to, rec.reason, rec.service, rec.at) == (
            rid,
            h["from"],
            h["state"],
            h["reason"],
            h["service"],
            pytest.approx(h["t"], abs=1e-4),
        )
        assert rec.owner == "key1"
    assert (feed[0].from_, feed[0].to, feed[0].service) == ("", "RECEIVED", "gateway")
    scheduled = [r for r in feed if r.to == "SCHEDULED"]
    assert [(r.worker, r.attempt) for r in scheduled] == [("worker-a", 1)]
    assert {(r.worker, r.attempt) for r in feed if r.to != "SCHEDULED"} == {("", 0)}
    assert [r.at for r in feed] == sorted(r.at for r in feed)


def test_refused_transitions_append_no_feed_record(redis_client, names):
    rid = _create(redis_client, names)
    lc = Lifecycle(redis_client, names, "test", 60)
    for to in PATH[:3]:
        lc.transition(rid, to, owner=Owner("w", 1) if to == State.SCHEDULED else None)
    before = redis_client.xlen(names.lifecycle_feed(0))
    assert lc.transition(rid, State.DECODING).status is Outcome.REFUSED  # not allowed from SCHEDULED
    assert lc.transition(rid, State.PREFILLING, fence=2).status is Outcome.FENCED  # a stale owner's attempt
    assert lc.transition(rid, State.SCHEDULED).status is Outcome.ALREADY_THERE  # a redelivered event: done already
    assert lc.transition("no-such-request", State.QUEUED).status is Outcome.MISSING
    assert lc.transition(rid, State.CANCELLED).applied
    assert lc.transition(rid, State.FAILED).status is Outcome.SETTLED  # settled already
    assert redis_client.xlen(names.lifecycle_feed(0)) == before + 1
    assert _feed(redis_client, names)[-1].to == "CANCELLED"


def test_refused_creation_appends_no_feed_record(redis_client, names):
    assert _create(redis_client, names, bounds=WaitingBounds(total=0)) == "overloaded"
    assert _create(redis_client, names, owner="k", bounds=WaitingBounds(per_owner=0)) == "key_overloaded"
    assert redis_client.xlen(names.lifecycle_feed(0)) == 0


def test_feed_is_capped(redis_client, names):
    store = ContextStore(redis_client, names, 60)
    pipe = redis_client.pipeline(transaction=False)
    for _ in range(LIFECYCLE_FEED_MAXLEN + 1000):
        ev = request_received()
        keys, argv = store.create_args(ev.request_id, {}, {}, ev)
        store._create(keys=keys, args=argv, client=pipe)
    pipe.execute()
    # MAXLEN ~ trims whole listpack nodes (100 entries by default): never more than one node over the cap.
    assert LIFECYCLE_FEED_MAXLEN <= redis_client.xlen(names.lifecycle_feed(0)) <= LIFECYCLE_FEED_MAXLEN + 100
