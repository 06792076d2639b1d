"""Hot paths read only what they need: liveness is one hash per service kind (readers never SCAN the keyspace),
listing one API key's requests reads only that key's contexts (issue 10, item 7), and the takeover sweep of
background responses reads one range per gateway, not the records of live gateways' responses."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI

from services.gateway.edge.auth import ApiKeyAuth, key_id
from services.gateway.responses import store, takeover
from services.gateway.ops.introspection import router as introspection_router
from services.gateway.session.metrics import cluster_figures
from services.scheduler.service import SchedulerService
from shared.wire.constants import LAYERS
from shared.state.context_store import ContextJanitor
from shared.state.lifecycle import Lifecycle, State
from shared.process.liveness import GatewayWatch
from shared.process.runtime import Liveness
from shared.settings import SchedulerSettings
from tests.support.inproc import TTL_S, calls, gateway_core, mark_live, small

KEY_A, KEY_B = "key-alpha-0123456789", "key-beta-9876543210"
OWNER_A, OWNER_B = key_id(KEY_A), key_id(KEY_B)


@pytest.fixture
def live(redis_server, redis_client, names):
    """One live tokenizer, scheduler and worker (with a heartbeat summary) and one gateway; stats reset."""
    mark_live(redis_client, names, ("tokenizer", "scheduler"))
    mark_live(
        redis_client,
        names,
        ("worker",),
        at=time.time(),
        running=3,
        waiting=0,
        held=3,
        total_blocks=100,
        free_blocks=75,
        cached_blocks=0,
        preemptions=2,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        step=7,
    )
    Liveness(names, "gateway", "gw-1", 1.0, TTL_S).refresh(redis_client)
    redis_client.config_resetstat()
    return redis_client


def test_gateway_ready_counts_live_services_without_scan(redis_server, names, live):
    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            return await core.ready()
        finally:
            await core.r.aclose()

    assert asyncio.run(run()) == {"tokenizer": 1, "scheduler": 1, "worker": 1}
    assert calls(live, "scan") == 0


def test_metrics_read_worker_liveness_without_scan(redis_server, names, live):
    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            return await cluster_figures(core.r, names)
        finally:
            await core.r.aclose()

    figures = asyncio.run(run())
    assert figures["running"] == 3 and figures["kv_usage"] == pytest.approx(0.25) and figures["prefix_hits"] == 4
    assert calls(live, "scan") == 0


def test_scheduler_gateway_liveness_check_runs_without_scan(redis_server, names, live):
    svc = SchedulerService(SchedulerSettings(redis_url=redis_server.url, namespace=names.ns))
    seen: list[set] = []
    check = svc.gateways.dead
    svc.gateways.dead = lambda alive, referenced: seen.append(set(alive)) or check(alive, referenced)
    svc.recover_lost()
    assert seen == [{"gw-1"}]
    assert calls(live, "scan") == 0


def test_the_takeover_sweep_reads_a_range_per_gateway_without_scan(redis_server, names, live):
    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            for gateway, n in (("gw-1", 50), ("gone", 1)):  # a live gateway's 50 responses, a dead one's record gone
                core.id = gateway
                for i in range(n):
                    await store.index_driving(core, "o", f"resp_{gateway}{i}")
            core.id = "gw-2"
            live.config_resetstat()
            watch = GatewayWatch(TTL_S)
            watch.missing_since["gone"] = time.monotonic() - 2 * TTL_S  # missing long enough to be judged dead
            taken = await takeover.sweep(core, watch)
            read = {c: calls(live, c) for c in ("scan", "zrangebylex", "hgetall")}
            return taken, read, await store.driving_gateways(core, 10)
        finally:
            await core.r.aclose()

    taken, read, left = asyncio.run(run())
    assert taken == 0 and left == ["gw-1"]  # the dead one's stale entry dropped, the live one's untouched
    # 3 steps over 2 gateways and the dead one's range; the gateways' liveness and the dead one's record (gone)
    assert read == {"scan": 0, "zrangebylex": 4, "hgetall": 2}


def _keyed_app(core) -> ApiKeyAuth:
    app = FastAPI()
    app.include_router(introspection_router)
    app.state.core = core
    return ApiKeyAuth(app, [KEY_A, KEY_B])


def _listing(redis_server, names, n_a: int, n_b: int, query: str) -> tuple[dict, int]:
    """n_b requests of key B, then n_a of key A; then key A lists with `query`. Returns the page and the number
    of HGETALLs the listing made."""

    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            for owner, n in ((OWNER_B, n_b), (OWNER_A, n_a)):
                for i in range(n):
                    await core.submit(small(f"{owner} {i}"), 2, owner=owner)
            await core.r.config_resetstat()
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=_keyed_app(core)), base_url="http://gw"
            ) as c:
                r = await c.get(f"/v1/requests?{query}", headers={"Authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 200, r.text
            info = await core.r.info("commandstats")
            return r.json(), info.get("cmdstat_hgetall", {}).get("calls", 0)
        finally:
            await core.r.aclose()

    return asyncio.run(run())


def test_listing_one_keys_requests_reads_only_that_keys_contexts(redis_server, names, live):
    page, hgetalls = _listing(redis_server, names, n_a=3, n_b=30, query="limit=2")
    assert [d["meta"]["owner"] for d in page["data"]] == [OWNER_A, OWNER_A]
    assert [d["input"]["prompt"] for d in page["data"]] == [f"{OWNER_A} 0", f"{OWNER_A} 1"]  # oldest first
    assert page["next_offset"] == 2
    assert hgetalls <= 2 * len(LAYERS)  # two contexts read, none of key B's 30


def test_listing_one_keys_requests_pages_by_offset(redis_server, names, live):
    page, hgetalls = _listing(redis_server, names, n_a=3, n_b=5, query="limit=2&offset=2")
    assert [d["input"]["prompt"] for d in page["data"]] == [f"{OWNER_A} 2"]
    assert page["next_offset"] is None and hgetalls <= len(LAYERS)


@pytest.mark.parametrize("how", ["expired", "evicted"])
def test_janitor_removes_a_forgotten_request_from_its_owners_index(redis_server, redis_client, names, live, how):
    async def create() -> list[str]:
        core = gateway_core(redis_server.url, names)
        try:
            return [(await core.submit(small(), 2, owner=OWNER_A)).request_id for _ in range(2)]
        finally:
            await core.r.aclose()

    ended, alive = asyncio.run(create())
    index = names.owner_index(0, OWNER_A)
    assert redis_client.zscore(index, ended) is not None and redis_client.zscore(index, alive) is not None
    Lifecycle(redis_client, names, "test", 1).transition(ended, State.CANCELLED, "client_cancel")
    if how == "expired":
        removed = ContextJanitor(redis_client, names, 1, cap=100).sweep(time.time() + 2)
    else:
        removed = ContextJanitor(redis_client, names, 3600, cap=0).sweep(time.time())
    assert removed == 1
    assert redis_client.zscore(index, ended) is None and redis_client.zscore(index, alive) is not None
