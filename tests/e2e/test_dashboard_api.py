"""The dashboard's data over HTTP (issue 14): its event stream, its key rules, and what a connection holds.

The session's `keyed_cluster` of real processes (simulated worker) with two API keys and an admin key."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from services.gateway.session.feed_hub import RESET, Subscriber
from tests.support.cluster import ADMIN, Cluster, KEY_A, KEY_B, auth as _auth
from tests.support.sse_reader import SseReader
from tests.support.waiting import wait_for

EVENTS = "/dashboard/api/events"


def _submit(c: Cluster, key: str, max_tokens: int = 8) -> dict:
    """Start a streamed request in a thread; returns {'rid': its id once known, 'done': Event}."""
    out: dict = {"done": threading.Event()}

    def run():
        body = {"prompt": "Hello dashboard", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{c.url}/generate", json=body, headers=_auth(key), timeout=300) as r:
            out["rid"] = r.headers.get("x-request-id")
            for _ in r.iter_lines():
                pass
        out["done"].set()

    threading.Thread(target=run, daemon=True).start()
    wait_for(lambda: out.get("rid"), 60, what="request id")
    return out


def _reader(c: Cluster, key: str) -> SseReader:
    reader = SseReader(c.url + EVENTS, _auth(key))
    reader.next("snapshot")
    return reader


def _connections(c: Cluster) -> int:
    text = httpx.get(f"{c.url}/metrics", headers=_auth(ADMIN), timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("conveyor:gateway_dashboard_connections "))
    return int(float(line.split()[1]))


def test_event_stream_sends_a_transition_within_a_second(keyed_cluster):
    reader = _reader(keyed_cluster, KEY_A)
    try:
        req = _submit(keyed_cluster, KEY_A)
        for state in ("RECEIVED", "QUEUED", "SCHEDULED", "DECODING", "FINISHED"):
            at, rec = reader.record(req["rid"], state)
            assert at - rec["at"] < 1.0, f"{state} reached the dashboard {at - rec['at']:.2f} s after it happened"
        assert rec["service"] == "worker" and "owner" not in rec
    finally:
        reader.close()


def test_event_stream_shows_a_key_its_own_requests_and_an_admin_all(keyed_cluster):
    a, b, admin = _reader(keyed_cluster, KEY_A), _reader(keyed_cluster, KEY_B), _reader(keyed_cluster, ADMIN)
    try:
        mine, theirs = _submit(keyed_cluster, KEY_A), _submit(keyed_cluster, KEY_B)
        for r in (a, admin):
            r.record(mine["rid"], "FINISHED")
        for r in (b, admin):
            r.record(theirs["rid"], "FINISHED")
        assert mine["rid"] not in b.rids() and theirs["rid"] not in a.rids()
    finally:
        for r in (a, b, admin):
            r.close()


def test_snapshot_lists_the_in_flight_requests_the_key_may_see(keyed_cluster):
    first = _reader(keyed_cluster, KEY_A)
    long = _submit(keyed_cluster, KEY_A, max_tokens=2000)
    try:
        first.record(long["rid"], "DECODING")
        late_a, late_b = (
            SseReader(keyed_cluster.url + EVENTS, _auth(KEY_A)),
            SseReader(keyed_cluster.url + EVENTS, _auth(KEY_B)),
        )
        _at, snap = late_a.next("snapshot")
        row = next(r for r in snap["rows"] if r["rid"] == long["rid"])
        assert row["state"] == "DECODING" and row["worker"] and row["attempt"] == 1 and row["prompt"] > 0
        _at, other = late_b.next("snapshot")
        assert long["rid"] not in {r["rid"] for r in other["rows"]}
        late_a.close(), late_b.close()
    finally:
        httpx.delete(f"{keyed_cluster.url}/v1/requests/{long['rid']}", headers=_auth(KEY_A), timeout=10)
        first.close()


def test_dashboard_data_wants_a_key_like_v1_requests(keyed_cluster):
    for path in (EVENTS, "/dashboard/api/config", "/dashboard/api/rows?ids=ab", "/dashboard/api/requests/ab"):
        assert httpx.get(keyed_cluster.url + path, timeout=10).status_code == 401
        assert httpx.get(keyed_cluster.url + path, headers=_auth("wrong"), timeout=10).status_code == 401
    page = httpx.get(f"{keyed_cluster.url}/dashboard", timeout=10)  # the page itself holds no data: its login form
    assert page.status_code == 200 and 'id="login"' in page.text


def test_the_login_takes_the_key_from_its_header_into_a_dashboard_only_cookie(keyed_cluster):
    with httpx.Client(base_url=keyed_cluster.url, timeout=10) as client:
        assert client.post("/dashboard/login", headers=_auth("wrong")).status_code == 401
        r = client.post("/dashboard/login", headers=_auth(KEY_A))
        assert r.status_code == 204, r.text
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
        assert client.get("/dashboard/api/config").json()["admin"] is False
        assert client.get("/v1/requests").status_code == 401  # the cookie is for the dashboard only


def test_a_key_in_a_dashboard_link_is_not_taken(keyed_cluster):
    """A `?key=` link would plant its key (the sender's) in whoever opens it, and put it in the access log."""
    with httpx.Client(base_url=keyed_cluster.url, timeout=10) as client:
        r = client.get(f"/dashboard?key={KEY_A}")
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"  # out of the address bar too
        assert "set-cookie" not in r.headers
        assert client.get("/dashboard/api/config").status_code == 401
        assert client.get(f"/dashboard/api/config?key={KEY_A}").status_code == 401


def test_a_request_is_read_and_cancelled_by_its_key_or_an_admin_only(keyed_cluster):
    req = _submit(keyed_cluster, KEY_A, max_tokens=2000)
    path = f"{keyed_cluster.url}/dashboard/api/requests/{req['rid']}"
    try:
        assert httpx.get(path, headers=_auth(KEY_B), timeout=10).status_code == 404
        assert httpx.delete(path, headers=_auth(KEY_B), timeout=10).status_code == 404
        d = httpx.get(path, headers=_auth(ADMIN), timeout=10).json()
        assert set(d) >= {"meta", "input", "exec", "kv", "output", "history", "intervals"}
        assert d["trace_url"] == f"http://jaeger.example:16686/trace/{d['trace_id']}" and len(d["trace_id"]) == 32
        assert (
            httpx.get(f"{keyed_cluster.url}/v1/requests/{req['rid']}", headers=_auth(ADMIN), timeout=10).status_code
            == 200
        )
        r = httpx.delete(path, headers=_auth(ADMIN), timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "CANCELLED"
    finally:
        httpx.delete(path, headers=_auth(KEY_A), timeout=10)


def test_rows_with_bad_ids_are_refused_naming_the_field(keyed_cluster):
    for ids in ("", ",", "a;b", ",".join(["ab"] * 201)):
        r = httpx.get(f"{keyed_cluster.url}/dashboard/api/rows", params={"ids": ids}, headers=_auth(KEY_A), timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "ids", ids


def test_one_feed_reader_serves_every_connection_and_disconnect_releases_it(keyed_cluster):
    import redis

    client = redis.Redis.from_url(keyed_cluster.redis.url)
    readers = [_reader(keyed_cluster, k) for k in (KEY_A, KEY_B, ADMIN)]
    wait_for(lambda: _connections(keyed_cluster) == 3, 10, what="three dashboard connections")
    blocked = [c for c in client.client_list() if c.get("cmd") == "xread"]
    assert len(blocked) <= 1  # one XREAD on the feed for the whole gateway, not one per browser
    for i, r in enumerate(readers):
        r.close()
        wait_for(lambda: _connections(keyed_cluster) == 2 - i, 10, what=f"{2 - i} connections left")
    # Nobody watches: the reader stops too, and no connection of it blocks on the feed.
    wait_for(
        lambda: not [c for c in client.client_list() if c.get("cmd") == "xread" and int(c["idle"]) < 1],
        10,
        what="the feed reader stopped",
    )
    client.close()


def test_a_connection_that_falls_behind_is_reset_not_grown():
    async def run():
        sub = Subscriber(None, 8)
        for i in range(100):
            sub.offer(("sse", b"%d" % i))
        return sub

    sub = asyncio.run(run())
    assert sub.queue.qsize() <= 8 and sub.resets >= 1
    items = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert RESET in items and items.index(RESET) == 0  # what it missed is replaced by one snapshot


@pytest.mark.parametrize("template", ["jaeger/trace/{trace_id}", "http://jaeger/trace/", "http://x/{trace_id}/{span}"])
def test_a_trace_url_template_without_its_placeholder_or_scheme_is_refused(template):
    from pydantic import ValidationError

    from shared.settings import GatewaySettings

    with pytest.raises(ValidationError, match="trace_url_template"):
        GatewaySettings(trace_url_template=template)
    assert GatewaySettings(trace_url_template="http://j:16686/trace/{trace_id}").trace_url_template
