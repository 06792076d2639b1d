"""A client's idle keep-alive connection stays usable for as long as HTTP clients keep one in their pools.

aiohttp reuses a pooled connection for up to 15 s; uvicorn's default closed it after 5 s idle, so a request sent on
a connection the server was closing at that moment failed in the client (AIPerf: "Can not write request body", one
request of a 160-request multi-turn run). The gateway keeps idle connections for `CONVEYOR_KEEP_ALIVE_S` (75 s)."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

IDLE_S = 7.0  # past uvicorn's default of 5 s, within aiohttp's pool time of 15 s


def test_a_connection_idle_past_five_seconds_still_carries_the_next_request(sim_cluster):
    where = urlsplit(sim_cluster.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        time.sleep(IDLE_S)  # the idle time is the behaviour under test: nothing to wait on instead
        conn.request("GET", "/health")  # on the same socket: a closed one fails here or in getresponse
        assert conn.getresponse().status == 200
    finally:
        conn.close()
