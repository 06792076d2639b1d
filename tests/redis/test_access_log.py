"""The access log during a start and beyond: a probe's polls (the launcher's /ready every 0.5 s, a load balancer's
/health) are logged when the answer changes, not at every poll; every other request is logged as it comes. The
real gateway app under a real uvicorn, on a test's own Redis."""

from __future__ import annotations

import httpx

from shared.redis_io.redis_server import free_port
from shared.settings import GatewaySettings
from tests.support.cache import CACHE_DIR
from tests.support.gateway_log import logged_gateway
from tests.support.inproc import mark_live
from tests.support.waiting import wait_for


def test_a_probes_polls_are_logged_only_when_its_answer_changes(redis_server, redis_client, names):
    settings = GatewaySettings(redis_url=redis_server.url, namespace=names.ns, cache_dir=CACHE_DIR, port=free_port())
    with logged_gateway(settings) as (url, records), httpx.Client(base_url=url, timeout=30) as c:
        starting = [c.get("/ready").status_code for _ in range(4)]  # no service live yet
        mark_live(redis_client, names)
        ready = [c.get("/ready").status_code for _ in range(4)]
        redis_client.delete(*redis_client.keys(f"{names.ns}*live*"))  # the services gone: not ready again
        gone = [c.get("/ready").status_code for _ in range(2)]
        asked = [c.get(path).status_code for path in ("/health", "/health", "/v1/models", "/v1/models")]
        want = ["GET /ready 503", "GET /ready 200", "GET /ready 503", "GET /health 200"]
        want += ["GET /v1/models 200"] * 2
        wait_for(lambda: len(records.access()) >= len(want), 30, what="the access lines")
    assert (starting, ready, gone, asked) == ([503] * 4, [200] * 4, [503] * 2, [200] * 4)
    assert records.access() == want
