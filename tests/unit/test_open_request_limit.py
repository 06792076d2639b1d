"""The gateway bounds the requests it serves at once (OpenRequestLimit, in front of a stand-in app): beyond the bound a
request gets 429 at once, and the dashboard's short reads still pass (the cluster-wide waiting bound, end to end:
tests/e2e/test_backpressure.py)."""

from __future__ import annotations

import asyncio

import httpx

from services.gateway.edge.middleware import OpenRequestLimit


def saturated(limit: int, then):
    """OpenRequestLimit(limit) in front of an app whose /generate answers only when released: `limit` of them are
    held open, then `then(client)` runs against the full gateway; -> (its result, the held answers, the client's
    answer to one more /generate after the release)."""
    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/generate":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limited = OpenRequestLimit(app, limit=limit, retry_after_s=3)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=limited), base_url="http://gw") as c:
            held = [asyncio.create_task(c.get("/generate")) for _ in range(limit)]
            while limited.open < limit:
                await asyncio.sleep(0.01)
            result = await then(c)
            release.set()
            done = await asyncio.gather(*held)
            return result, done, await c.get("/generate")

    return asyncio.run(run())


def test_open_request_limit_refuses_beyond_bound_and_recovers():
    refused, done, after = saturated(2, lambda c: c.get("/generate"))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["code"] == "too_many_open_requests"
    assert [d.status_code for d in done] == [200, 200] and after.status_code == 200


def test_dashboard_reads_are_served_when_the_open_request_limit_is_reached():
    """A saturated gateway is when the dashboard is needed: its page and short reads pass the open-request
    limit like the probes; its long-lived event stream still counts (each one holds a connection)."""

    async def dashboard(c):
        reads = [
            await c.get(p)
            for p in ("/dashboard", "/dashboard/api/config", "/dashboard/api/rows?ids=a", "/dashboard/api/requests/a")
        ]
        return reads, await c.get("/dashboard/api/events")

    (reads, stream), _done, _after = saturated(1, dashboard)
    assert [r.status_code for r in reads] == [200, 200, 200, 200]
    assert stream.status_code == 429
