"""Nothing unbounded: every key a request leaves has a TTL from birth, also the ones written after it ended;
a dead process's stream expires; stream entries every reader is done with are dropped."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from shared.wire.bus import Bus
from shared.wire.constants import PRIVATE_STREAM_TTL_S
from shared.state.context_store import ContextStore
from shared.state.lifecycle import Lifecycle, Owner, Publish, State
from tests.support.factories import request_received

CONTEXT_TTL_S = 60


def _create(redis_server, names) -> str:
    ev = request_received()

    async def create():
        client = aioredis.Redis.from_url(redis_server.url)
        await ContextStore(client, names, 600).acreate(ev.request_id, {"priority": 0}, {"prompt": "x"}, ev)
        await client.aclose()

    asyncio.run(create())
    return ev.request_id


@pytest.mark.parametrize("layer", ["kv", "output", "exec"])
def test_a_layer_first_written_after_settlement_expires_with_the_context(redis_server, redis_client, names, layer):
    rid = _create(redis_server, names)
    lc = Lifecycle(redis_client, names, "test", CONTEXT_TTL_S)
    assert lc.transition(rid, State.CANCELLED, "client_cancel").applied
    ContextStore(redis_client, names, 600).update(redis_client, rid, layer, {"late": 1})  # e.g. kv after a cancel
    assert 0 < redis_client.ttl(names.layer(rid, layer)) <= CONTEXT_TTL_S


def test_a_layer_written_after_the_context_is_gone_is_not_created(redis_server, redis_client, names):
    rid = _create(redis_server, names)
    redis_client.delete(*names.request_keys(rid))  # expired or evicted
    assert ContextStore(redis_client, names, 600).update(redis_client, rid, "output", {"text": "late"}) == 0
    assert not redis_client.exists(names.layer(rid, "output"))


def test_the_exec_layer_has_a_ttl_from_the_placement_that_creates_it(redis_server, redis_client, names):
    rid = _create(redis_server, names)
    lc = Lifecycle(redis_client, names, "test", CONTEXT_TTL_S)
    for s in (State.PREPROCESSED, State.QUEUED):
        lc.transition(rid, s)
    assert lc.transition(rid, State.SCHEDULED, owner=Owner("w1", 1)).applied
    assert redis_client.hget(names.layer(rid, "exec"), "attempt") == b"1"
    assert 0 < redis_client.ttl(names.layer(rid, "exec")) <= 600


def test_a_process_stream_written_by_others_gets_a_ttl_and_a_shared_one_does_not(redis_server, redis_client, names):
    rid = _create(redis_server, names)
    end = Publish(names.reply_stream("dead-gateway"), request_received())
    Lifecycle(redis_client, names, "test", CONTEXT_TTL_S).transition(rid, State.CANCELLED, "x", [end])
    Bus(redis_client, names, "c", 100, 1000, 3).publish(names.worker_stream("dead-worker"), request_received())
    assert 0 < redis_client.ttl(names.reply_stream("dead-gateway")) <= PRIVATE_STREAM_TTL_S
    assert 0 < redis_client.ttl(names.worker_stream("dead-worker")) <= PRIVATE_STREAM_TTL_S
    assert redis_client.ttl(names.received_stream(0)) == -1  # shared: lives as long as the cluster


def test_entries_every_group_has_handled_are_trimmed_and_pending_ones_kept(redis_client, names):
    bus = Bus(redis_client, names, "c", 100, 1000, 3)
    stream = names.preprocessed_stream(0)
    bus.ensure_group(stream, "g")
    for _ in range(10):
        bus.publish(stream, request_received())
    first = bus.read([stream], "g", count=4, block_ms=0)
    for d in first[:3]:
        bus.ack_all([d])  # the fourth stays pending
    bus.trim_consumed(stream)
    left = [e[0].decode() for e in redis_client.xrange(stream)]
    assert left[0] == first[3].entry_id and len(left) == 7
