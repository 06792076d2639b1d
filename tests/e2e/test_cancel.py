"""Cancelling: DELETE and client disconnect stop the work and free the worker's KV blocks."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
import redis

from shared.wire.constants import Names
from shared.process.liveness import read_live
from tests.support.openai_fixtures import MODEL
from tests.support.waiting import wait_for

LONG = {"prompt": "Count from one to a thousand:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def _worker_idle(cluster) -> bool:
    r = redis.Redis.from_url(cluster.redis.url)
    infos = list(read_live(r, Names(cluster.ns), "worker").values())
    # free_blocks counts cached-but-unreferenced blocks too: all free = nothing held by any request.
    return bool(infos) and all(
        i["held"] == 0 and i["running"] == 0 and i["free_blocks"] == i["total_blocks"] for i in infos
    )


def _state(cluster, rid: str) -> str:
    return httpx.get(f"{cluster.url}/v1/requests/{rid}", timeout=10).json()["state"]


def test_delete_while_decoding_cancels_and_frees_blocks(cluster):
    events: list[dict] = []
    started = threading.Event()

    def consume():
        with httpx.stream("POST", f"{cluster.url}/generate", json={**LONG, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) >= 3:
                        started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(60)
    rid = events[0]["request_id"]
    r = httpx.delete(f"{cluster.url}/v1/requests/{rid}", timeout=10)
    assert r.status_code == 200 and r.json() == {"request_id": rid, "cancelled": True, "state": "CANCELLED"}
    t.join(60)
    final = events[-1]
    assert final["finish_reason"] == "cancelled" and final["error"]["code"] == "client_cancel"
    assert _state(cluster, rid) == "CANCELLED"
    wait_for(lambda: _worker_idle(cluster), 30, what="worker released every block")
    again = httpx.delete(f"{cluster.url}/v1/requests/{rid}", timeout=10).json()
    assert again["cancelled"] is False and again["state"] == "CANCELLED"


def test_client_disconnect_mid_stream_cancels_request(cluster):
    rid = None
    with httpx.stream("POST", f"{cluster.url}/generate", json={**LONG, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                rid = json.loads(line[6:])["request_id"]
                break
    assert rid
    wait_for(lambda: _state(cluster, rid) == "CANCELLED", 30, what="request cancelled")
    snap = httpx.get(f"{cluster.url}/v1/requests/{rid}", timeout=10).json()
    assert snap["history"][-1]["reason"] == "client_disconnect"
    wait_for(lambda: _worker_idle(cluster), 30, what="worker released every block")


def _open_requests(cluster) -> float:
    found = re.search(
        r"^conveyor:gateway_open_requests (\S+)$", httpx.get(f"{cluster.url}/metrics", timeout=10).text, re.M
    )
    assert found, "the gateway exports conveyor:gateway_open_requests"
    return float(found.group(1))


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_client_disconnect_mid_stream_releases_the_gateway_handle(cluster, path):
    body = {**LONG, "stream": True, **({"model": MODEL} if path.startswith("/v1/") else {})}
    with httpx.stream("POST", f"{cluster.url}{path}", json=body, timeout=120) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_for(lambda: _state(cluster, rid) == "CANCELLED", 30, what="request cancelled")
    wait_for(lambda: _open_requests(cluster) == 0, 30, what="the gateway forgot the request")
