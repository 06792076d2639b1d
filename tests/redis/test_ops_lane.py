"""Reads that look into the cluster (/ready, /v1/requests, /metrics, the dashboard's API) are exempt from the
open-request limit, so they must never hold the connections requests are created with: a flood of them, on a
gateway whose request pool is small, leaves every creation its connection (issue 24, item 14)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from services.gateway.edge.errors import Unavailable
from services.gateway.ops.introspection import router as introspection_router
from services.gateway.session.request import GenerateRequest
from services.gateway.session.core import GatewayCore
from shared.redis_io.redis_client import async_client
from shared.settings import GatewaySettings
from tests.support.inproc import mark_live

POOL = 2
BACKLOG = 300  # requests waiting: what a listing of every state reads


def _core(redis_url: str, names) -> GatewayCore:
    s = GatewaySettings(redis_url=redis_url, namespace=names.ns, redis_pool_timeout_s=0.3)
    return GatewayCore(s, async_client(s, POOL, s.redis_pool_timeout_s), None, "test-model")


def test_a_flood_of_introspection_reads_leaves_request_creation_its_connections(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        core = _core(redis_server.url, names)
        app = FastAPI()
        app.include_router(introspection_router)
        app.state.core = core
        try:
            for i in range(BACKLOG):
                await core.submit(GenerateRequest(prompt=f"waiting {i}", max_tokens=2), 2)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=120
            ) as c:
                flood = [asyncio.create_task(c.get("/v1/requests?limit=100")) for _ in range(40)]
                await asyncio.sleep(0)  # the flood has started and holds what it takes
                outcomes = []
                for i in range(5):
                    try:
                        outcomes.append(
                            (await core.submit(GenerateRequest(prompt=f"new {i}", max_tokens=2), 2)).request_id
                        )
                    except Unavailable as e:
                        outcomes.append(e)
                listings = await asyncio.gather(*flood)
            return outcomes, listings
        finally:
            await core.r.aclose()

    outcomes, listings = asyncio.run(run())
    assert all(isinstance(o, str) for o in outcomes), outcomes
    assert all(r.status_code == 200 for r in listings)
