"""Per-key fairness: one API key cannot fill every waiting or open-request slot (issue 10, item 8)."""

from __future__ import annotations

import asyncio

import httpx
import pydantic
import pytest

from services.gateway.app import create_app
from services.gateway.edge.auth import key_id
from services.gateway.edge.errors import Overloaded
from shared.state.lifecycle import Lifecycle, State
from shared.settings import GatewaySettings
from tests.support.inproc import gateway_core, mark_live, small

KEY_A, KEY_B = "key-alpha-0123456789", "key-beta-9876543210"
OWNER_A, OWNER_B = key_id(KEY_A), key_id(KEY_B)
PER_KEY = 2


def _submit_all(redis_server, names, plan: list[str], **settings) -> list:
    """Submit one request per owner in `plan`, in order; returns each request id, or the error it got."""

    async def run():
        core = gateway_core(redis_server.url, names, **settings)
        out = []
        try:
            for owner in plan:
                try:
                    out.append((await core.submit(small(), 2, owner=owner)).request_id)
                except Overloaded as e:
                    out.append(e)
        finally:
            await core.r.aclose()
        return out

    return asyncio.run(run())


def test_a_key_beyond_its_waiting_bound_gets_429_while_another_key_is_admitted(redis_server, redis_client, names):
    mark_live(redis_client, names)
    out = _submit_all(redis_server, names, [OWNER_A] * (PER_KEY + 1) + [OWNER_B], max_waiting_requests_per_key=PER_KEY)
    *admitted_a, refused, admitted_b = out
    assert all(isinstance(rid, str) for rid in admitted_a) and isinstance(admitted_b, str)
    assert isinstance(refused, Overloaded) and refused.status == 429 and refused.code == "key_overloaded"
    assert f"limit {PER_KEY}" in refused.message and "CONVEYOR_MAX_WAITING_REQUESTS_PER_KEY" in refused.message
    assert refused.headers["Retry-After"] == "1"
    assert _owner_waiting(redis_client, names, OWNER_A) == PER_KEY  # the refused one was never created
    assert _owner_waiting(redis_client, names, OWNER_B) == 1


def test_a_key_at_its_waiting_bound_is_admitted_again_once_one_of_its_requests_is_placed(
    redis_server, redis_client, names
):
    mark_live(redis_client, names)
    first, *_ = _submit_all(redis_server, names, [OWNER_A] * PER_KEY, max_waiting_requests_per_key=PER_KEY)
    lc = Lifecycle(redis_client, names, "test", 60)
    for s in (State.PREPROCESSED, State.QUEUED, State.SCHEDULED):  # on a worker now: no longer waiting
        lc.transition(first, s)
    [again] = _submit_all(redis_server, names, [OWNER_A], max_waiting_requests_per_key=PER_KEY)
    assert isinstance(again, str)


def test_without_api_keys_there_is_no_per_key_waiting_bound(redis_server, redis_client, names):
    mark_live(redis_client, names)
    out = _submit_all(redis_server, names, [""] * (PER_KEY + 2), max_waiting_requests_per_key=PER_KEY)
    assert all(isinstance(rid, str) for rid in out)
    assert redis_client.zcard(names.waiting(0)) == PER_KEY + 2


def test_a_key_beyond_its_open_request_bound_gets_429_while_another_key_is_served():
    app = create_app(GatewaySettings(api_keys=[KEY_A, KEY_B], max_open_requests_per_key=PER_KEY))
    release, entered = asyncio.Event(), []

    @app.get("/hold")
    async def hold():
        entered.append(1)
        await release.wait()
        return {"ok": True}

    def auth(key: str) -> dict:
        return {"Authorization": f"Bearer {key}"}

    async def until(check) -> None:
        while not check():
            await asyncio.sleep(0.01)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            held = [asyncio.create_task(c.get("/hold", headers=auth(KEY_A))) for _ in range(PER_KEY)]
            await asyncio.wait_for(until(lambda: len(entered) == PER_KEY), 10)
            extra_a = asyncio.create_task(c.get("/hold", headers=auth(KEY_A)))
            # Either key A's extra request is refused at once, or (no per-key bound) it gets in and is held.
            await asyncio.wait_for(until(lambda: extra_a.done() or len(entered) > PER_KEY), 10)
            b = asyncio.create_task(c.get("/hold", headers=auth(KEY_B)))
            await asyncio.wait_for(until(lambda: len(entered) > PER_KEY), 10)  # key B's request is being served
            release.set()
            return await extra_a, await asyncio.gather(*held), await b, await c.get("/hold", headers=auth(KEY_A))

    refused, done, served_b, after = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "too_many_open_requests_for_key"
    assert f"limit {PER_KEY}" in err["message"] and "CONVEYOR_MAX_OPEN_REQUESTS_PER_KEY" in err["message"]
    assert [d.status_code for d in done] == [200] * PER_KEY and served_b.status_code == 200
    assert after.status_code == 200  # key A's slots are free again


@pytest.mark.parametrize("field", ["max_open_requests_per_key", "max_waiting_requests_per_key"])
def test_per_key_bounds_must_be_positive(field):
    assert getattr(GatewaySettings(), field) > 0
    with pytest.raises(pydantic.ValidationError):
        GatewaySettings(**{field: 0})


def _owner_waiting(client, names, owner: str) -> int:
    """An API key's waiting requests: its members (owner NUL request id) of the owner-waiting set."""
    return client.zlexcount(names.owner_waiting(0), f"[{owner}\0", f"({owner}\1")
