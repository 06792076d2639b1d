"""No API key in any log line (issue 24, item 12): uvicorn's access log wrote `/dashboard?key=<admin key>` as it
came. The real gateway app under a real uvicorn, on a test's own Redis; every record of uvicorn's loggers and of
the app's is captured as it is made, during requests that carry keys in the query string, headers and cookies."""

from __future__ import annotations

import httpx
import pytest

from shared.redis_io.redis_server import free_port
from shared.settings import GatewaySettings
from tests.support.cache import CACHE_DIR
from tests.support.gateway_log import logged_gateway
from tests.support.inproc import mark_live
from tests.support.waiting import wait_for

KEY, ADMIN = "key-log-user-4242424242", "key-log-admin-1717171717"
STRANGER = "key-not-configured-31337"  # a secret too, though not one of ours (a typo, another deployment's)


@pytest.fixture
def gateway(redis_server, redis_client, names):
    """A gateway (uvicorn + the app) in a thread; its loggers' records go to the returned Records."""
    settings = GatewaySettings(
        redis_url=redis_server.url,
        namespace=names.ns,
        cache_dir=CACHE_DIR,
        api_keys=[KEY],
        admin_api_keys=[ADMIN],
        port=free_port(),
    )
    mark_live(redis_client, names)
    with logged_gateway(settings) as running:
        yield running


def _sent(url: str) -> list[httpx.Response]:
    bearer = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=30) as c:
        return [
            c.get(f"/dashboard?key={ADMIN}"),
            c.get(f"/dashboard/api/config?key={KEY}&x=1"),
            c.get(f"/v1/models?api_key={KEY}", headers=bearer),
            c.get(f"/v1/requests?token={STRANGER}", headers=bearer),
            c.get(f"/no-such-path?key={STRANGER}&password={STRANGER}", headers=bearer),
            c.get("/v1/models", headers={"Authorization": f"Bearer {STRANGER}"}),
            c.get("/ready", headers={"Authorization": f"Bearer {ADMIN}", "Cookie": f"conveyor_dashboard_key={KEY}"}),
            c.post("/generate", json={"prompt": "x", "max_tokens": 0}, headers=bearer),
            c.get(f"/health?key={ADMIN}"),
        ]


def test_no_key_reaches_a_log_record(gateway):
    url, records = gateway
    answers = _sent(url)
    wait_for(
        lambda: sum(r.name == "uvicorn.access" for r in records.records) >= len(answers),
        30,
        what="an access log line per request",
    )
    lines = records.lines()
    assert len(lines) >= len(answers)
    for secret in (KEY, ADMIN, STRANGER):
        leaked = [line for line in lines if secret in line]
        assert not leaked, leaked
    # the lines still say what was asked for (the path, the other query parameters)
    assert any("/dashboard/api/config?key=" in line and "x=1" in line for line in lines), lines
