"""Stored responses outlive the processes around them: a response created through one gateway is read and
continued through another, also once the first is killed, and survives a Redis restart from its append-only file
(its TTL with it)."""

from __future__ import annotations

import os
import signal

import httpx
import redis

from shared.constants import Names
from shared.redis_server import RedisServer, free_port
from tests.support.openai_fixtures import MODEL, openai_client
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

FAST = {"CONVEYOR_LIVENESS_TTL_S": "3", "CONVEYOR_HEARTBEAT_INTERVAL_S": "0.5", "CONVEYOR_CLAIM_IDLE_MS": "1000"}
TTL_S = 3600


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stored_response_outlives_its_gateway_and_a_redis_restart(start_cluster):
    c = start_cluster(env={**FAST, **SIM, "CONVEYOR_RESPONSES_TTL_S": str(TTL_S)}, redis_appendonly=True)
    other = f"http://127.0.0.1:{free_port()}"
    c.start_service("gateway2", {"CONVEYOR_PORT": other.rsplit(":", 1)[1]})
    wait_for(lambda: _ready(other), 120, what="the second gateway")
    first, second = openai_client(c.url), openai_client(other)

    resp = first.responses.create(model=MODEL, input="Name a river", max_output_tokens=6, temperature=0)
    assert second.responses.retrieve(resp.id).output_text == resp.output_text
    os.kill(c.procs["gateway"].pid, signal.SIGKILL)
    c.procs["gateway"].wait()
    follow = second.responses.create(model=MODEL, input="And a sea?", previous_response_id=resp.id, max_output_tokens=4)
    assert follow.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens

    port = c.redis.port
    c.redis.stop()  # SIGTERM: Redis flushes its append-only file
    c.redis = RedisServer(c.redis.data_dir, port=port, appendonly=True).start()
    wait_for(lambda: _ready(other), 60, what="ready again")
    for r in (resp, follow):
        assert second.responses.retrieve(r.id).output_text == r.output_text
    ttl = redis.Redis.from_url(c.redis.url).ttl(Names(c.ns).response("", resp.id))
    assert 0 < ttl <= TTL_S


def _ended(client, response_id: str):
    got = client.responses.retrieve(response_id)
    return got if got.status not in ("queued", "in_progress") else None


def test_a_background_response_whose_gateway_died_is_settled_failed_by_another(start_cluster):
    c = start_cluster(env={**FAST, **SIM})
    other = f"http://127.0.0.1:{free_port()}"
    c.start_service("gateway2", {"CONVEYOR_PORT": other.rsplit(":", 1)[1]})
    wait_for(lambda: _ready(other), 120, what="the second gateway")
    first, second = openai_client(c.url), openai_client(other)
    resp = first.responses.create(model=MODEL, input="Count to a thousand", background=True, max_output_tokens=400)
    wait_for(lambda: second.responses.retrieve(resp.id).status == "in_progress", 30, what="the response running")
    os.kill(c.procs["gateway"].pid, signal.SIGKILL)
    c.procs["gateway"].wait()
    lost = wait_for(lambda: _ended(second, resp.id), 30, what="the orphan settled")
    assert lost.status == "failed" and lost.error.code == "gateway_lost"
    rid = resp.id.removeprefix("resp_")
    r = redis.Redis.from_url(c.redis.url)
    wait_for(lambda: r.hget(Names(c.ns).layer(rid, "meta"), "state") == b"CANCELLED", 30, what="its work stopped")
