"""Stored responses on a real Redis (services/gateway/responses/store.py): born with their TTL, keyed by their
owner, written while they run only until a cancel, a deletion or their end has the last word, and their event
log born with the same TTL; a background response is taken over by one gateway only, after which its stale
driver's writes are refused, and the driving index names each dead gateway's responses."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from services.gateway.edge.errors import NotFound
from services.gateway.responses import store, takeover
from shared.state.context_store import ContextStore
from shared.process.liveness import GatewayWatch

TTL_S = 600


def _stored(status: str, rid: str = "resp_abc", background: bool = False) -> store.Stored:
    response = {"id": rid, "status": status, "output": [], "background": background}
    return store.Stored(response, [], [], reply_to="r", gateway="g1")


def _run(redis_server, names, work):
    async def main():
        r = aioredis.Redis.from_url(redis_server.url)
        store_ = ContextStore(r, names, TTL_S)
        core = SimpleNamespace(r=r, names=names, s=SimpleNamespace(responses_ttl_s=TTL_S), id="g2", store=store_)
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
        await store.put(core, "o", _stored("in_progress", background=True))
        await store.append_events(core, "o", "resp_abc", [{"type": "a", "sequence_number": 0}], True, 0, 0)
        await store.append_events(core, "o", "resp_abc", [{"type": "b", "sequence_number": 1}], False, 0, 5)
        every = await store.read_events(core, "o", "resp_abc", "0-0", None)
        after_first = await store.read_events(core, "o", "resp_abc", every[0][0], None)
        return every, after_first

    every, after_first = _run(redis_server, names, work)
    assert [e["type"] for _, e in every] == ["a", "b"] and [e["type"] for _, e in after_first] == ["b"]
    assert 0 < redis_client.ttl(names.response_events("o", "resp_abc")) <= TTL_S


def test_a_background_response_is_claimed_once_and_its_stale_driver_is_refused(redis_server, names):
    async def work(core):
        await store.put(core, "o", _stored("in_progress", background=True))
        dead = await store.get(core, "o", "resp_abc")
        fences = [await store.claim(core, "o", dead), await store.claim(core, "o", dead)]
        event = [{"type": "x", "sequence_number": 0}]
        stale = (
            await store.update_running(core, "o", _stored("completed"), fence=0),
            await store.append_events(core, "o", "resp_abc", event, True, 0, 0),
        )
        fresh = (
            await store.append_events(core, "o", "resp_abc", event, True, fences[0], 3),
            await store.update_running(core, "o", _stored("completed"), fence=fences[0]),
        )
        return fences, stale, fresh, await store.read_log(core, "o", "resp_abc"), await store.get(core, "o", "resp_abc")

    fences, stale, fresh, log, now = _run(redis_server, names, work)
    assert fences == [1, None]  # the second claim of the dead driver finds it taken
    assert stale == (False, False) and fresh == (True, True)
    assert log == [(3, {"type": "x", "sequence_number": 0})]
    assert now.gateway == "g2" and now.response["status"] == "completed"


def test_the_driving_index_names_each_gateway_and_its_responses(redis_server, names):
    async def work(core):
        for gateway, rid in (("g1", "resp_a"), ("g1", "resp_b"), ("g3", "resp_c")):
            core.id = gateway
            await store.index_driving(core, "o", rid)
        core.id = "g2"
        await store.index_driving(core, "o", "resp_c")  # taken over from g3
        await store.unindex(core, "g3", "o", "resp_c")
        return await store.driving_gateways(core, 10), await store.driven_by(core, "g1", 10)

    gateways, of_g1 = _run(redis_server, names, work)
    assert gateways == ["g1", "g2"]
    assert of_g1 == [("o", "resp_a"), ("o", "resp_b")]


def test_a_response_whose_gateway_and_request_are_gone_is_settled_failed(redis_server, names):
    async def work(core):
        await store.put(core, "owner", _stored("in_progress", background=True))
        await store.index_driving(SimpleNamespace(**{**vars(core), "id": "g1"}), "owner", "resp_abc")
        settled = await takeover.take_over(core, "owner", await store.get(core, "owner", "resp_abc"))
        return settled, await store.driving_gateways(core, 10)

    settled, gateways = _run(redis_server, names, work)
    assert settled.response["status"] == "failed" and settled.response["error"]["code"] == "gateway_lost"
    assert gateways == []  # out of the index: nobody drives it any more


def test_the_sweep_leaves_a_response_whose_gateway_has_been_missing_less_than_a_ttl(redis_server, names):
    async def work(core):
        await store.put(core, "owner", _stored("in_progress", background=True))
        await store.index_driving(SimpleNamespace(**{**vars(core), "id": "g1"}), "owner", "resp_abc")
        watch = GatewayWatch(TTL_S)  # g1 not live: just missing, as after a Redis outage every entry is stale
        return await takeover.sweep(core, watch), await store.get(core, "owner", "resp_abc")

    taken, now = _run(redis_server, names, work)
    assert taken == 0 and (now.gateway, now.fence, now.response["status"]) == ("g1", 0, "in_progress")
