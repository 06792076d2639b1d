"""Stored responses on a real Redis (services/gateway/responses/store.py): born with their TTL, keyed by their
owner, written while they run only until a cancel, a deletion or their end has the last word, and their event
log born with the same TTL."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from services.gateway.edge.errors import NotFound
from services.gateway.responses import store

TTL_S = 600


def _stored(status: str, rid: str = "resp_abc") -> store.Stored:
    return store.Stored({"id": rid, "status": status, "output": []}, [], [], reply_to="r", gateway="g1")


def _run(redis_server, names, work):
    async def main():
        r = aioredis.Redis.from_url(redis_server.url)
        core = SimpleNamespace(r=r, names=names, s=SimpleNamespace(responses_ttl_s=TTL_S), id="g2")
        try:
            return await work(core)
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_a_stored_response_is_born_with_its_ttl_and_read_back_whole(redis_server, names, redis_client):
    async def work(core):
        await store.put(core, "owner", _stored("completed"))
        return await store.get(core, "owner", "resp_abc")

    got = _run(redis_server, names, work)
    assert got == _stored("completed")
    assert 0 < redis_client.ttl(names.response("owner", "resp_abc")) <= TTL_S


def test_another_owner_cannot_read_it(redis_server, names):
    async def work(core):
        await store.put(core, "owner", _stored("completed"))
        with pytest.raises(NotFound):
            await store.get(core, "someone-else", "resp_abc")

    _run(redis_server, names, work)


@pytest.mark.parametrize("status", ["completed", "cancelled", "failed"])
def test_a_running_write_after_the_last_word_changes_nothing(redis_server, names, status):
    async def work(core):
        await store.put(core, "owner", _stored("in_progress"))
        assert await store.update_running(core, "owner", _stored(status))
        assert not await store.update_running(
            core, "owner", _stored("completed" if status != "completed" else "failed")
        )
        return (await store.get(core, "owner", "resp_abc")).response["status"]

    assert _run(redis_server, names, work) == status


def test_a_running_write_to_a_deleted_response_does_not_bring_it_back(redis_server, names, redis_client):
    async def work(core):
        await store.put(core, "owner", _stored("in_progress"))
        await store.delete(core, "owner", "resp_abc")
        return await store.update_running(core, "owner", _stored("completed"))

    assert not _run(redis_server, names, work)
    assert not redis_client.exists(names.response("owner", "resp_abc"))


def test_the_event_log_is_born_with_the_ttl_and_read_after_an_entry(redis_server, names, redis_client):
    async def work(core):
        await store.append_events(core, "o", "resp_abc", [{"type": "a", "sequence_number": 0}], first=True)
        await store.append_events(core, "o", "resp_abc", [{"type": "b", "sequence_number": 1}], first=False)
        every = await store.read_events(core, "o", "resp_abc", "0-0", None)
        after_first = await store.read_events(core, "o", "resp_abc", every[0][0], None)
        return every, after_first

    every, after_first = _run(redis_server, names, work)
    assert [e["type"] for _, e in every] == ["a", "b"] and [e["type"] for _, e in after_first] == ["b"]
    assert 0 < redis_client.ttl(names.response_events("o", "resp_abc")) <= TTL_S


def test_a_response_running_under_a_gateway_that_is_not_live_is_settled_failed(redis_server, names):
    async def work(core):
        await store.put(core, "owner", _stored("in_progress"))
        settled = await store.orphan_settled(core, "owner", await store.get(core, "owner", "resp_abc"))
        return settled, await store.get(core, "owner", "resp_abc")

    settled, again = _run(redis_server, names, work)
    assert settled.response["status"] == again.response["status"] == "failed"
    assert again.response["error"]["code"] == "gateway_lost"
