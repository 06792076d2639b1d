"""The context store: layers, expiry of ended contexts, and the cap on stored ones."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from shared.state.context_store import ContextJanitor, ContextStore
from shared.state.lifecycle import Lifecycle, State
from tests.support.factories import request_received


def _create(redis_server, names, n: int) -> list[str]:
    async def run():
        client = aioredis.Redis.from_url(redis_server.url)
        store = ContextStore(client, names, 60)
        ids = []
        for _ in range(n):
            ev = request_received()
            await store.acreate(ev.request_id, {"priority": 0}, {"prompt": ev.prompt}, ev)
            ids.append(ev.request_id)
        await client.aclose()
        return ids

    return asyncio.run(run())


def test_created_request_has_meta_input_history_and_is_waiting(redis_server, redis_client, names):
    [rid] = _create(redis_server, names, 1)
    snap = ContextStore(redis_client, names, 60).read(redis_client, rid)
    assert snap.state == State.RECEIVED and snap.layers["input"]["prompt"] == "Hello"
    assert [h["state"] for h in snap.history] == ["RECEIVED"]
    assert redis_client.zscore(names.waiting(0), rid) is not None
    assert redis_client.zscore(names.state_set(0, "RECEIVED"), rid) is not None


def test_state_sets_follow_transitions(redis_server, redis_client, names):
    [rid] = _create(redis_server, names, 1)
    lc = Lifecycle(redis_client, names, "test", 60)
    for s in (State.PREPROCESSED, State.QUEUED, State.SCHEDULED):
        lc.transition(rid, s)
    assert redis_client.zscore(names.state_set(0, "SCHEDULED"), rid) is not None
    assert redis_client.zscore(names.state_set(0, "RECEIVED"), rid) is None
    assert redis_client.zscore(names.waiting(0), rid) is None  # on a worker now


def test_janitor_evicts_oldest_ended_contexts_beyond_the_cap(redis_server, redis_client, names):
    ids = _create(redis_server, names, 5)
    lc = Lifecycle(redis_client, names, "test", 3600)
    for rid in ids[:4]:  # four end, one stays live
        lc.transition(rid, State.CANCELLED, "client_cancel")
    removed = ContextJanitor(redis_client, names, 3600, cap=2).sweep(time.time())
    assert removed == 2
    assert [redis_client.exists(names.layer(r, "meta")) for r in ids] == [0, 0, 1, 1, 1]
    assert redis_client.zcard(names.state_set(0, "CANCELLED")) == 2


def test_janitor_forgets_index_entries_of_expired_contexts(redis_server, redis_client, names):
    ids = _create(redis_server, names, 2)
    lc = Lifecycle(redis_client, names, "test", 1)
    lc.transition(ids[0], State.FAILED, "internal")
    removed = ContextJanitor(redis_client, names, 1, cap=100).sweep(time.time() + 2)
    assert removed == 1 and redis_client.zcard(names.state_set(0, "FAILED")) == 0
    assert redis_client.zscore(names.requests_index(0), ids[0]) is None
