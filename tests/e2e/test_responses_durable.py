"""Stored responses outlive the processes around them: a response created through one gateway is read and
continued through another, also once the first is killed, and survives a Redis restart from its append-only file
(its TTL with it)."""

from __future__ import annotations

import os
import signal

import httpx
import redis

from shared.wire.constants import Names
from shared.redis_io.redis_server import RedisServer, free_port
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


def _deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_whose_gateway_died_is_completed_by_another(start_cluster):
    c = start_cluster(env={**FAST, **SIM})
    other = f"http://127.0.0.1:{free_port()}"
    c.start_service("gateway2", {"CONVEYOR_PORT": other.rsplit(":", 1)[1]})
    wait_for(lambda: _ready(other), 120, what="the second gateway")
    first, second = openai_client(c.url), openai_client(other)
    body = dict(model=MODEL, input="Count to a thousand", max_output_tokens=160, temperature=0, background=True)
    # Baseline: what the greedy simulated engine answers when nothing dies.
    base = second.responses.create(**body)
    reference = wait_for(lambda: _ended(second, base.id), 60, what="the baseline")
    # Fault: the gateway driving it is killed mid-generation, its stream with it.
    seen = []
    for event in first.responses.create(stream=True, **body):
        seen.append(event)
        if len(seen) >= 8:
            break
    assert _deltas(seen) and seen[-1].type == "response.output_text.delta"
    os.kill(c.procs["gateway"].pid, signal.SIGKILL)
    c.procs["gateway"].wait()
    # Recovery: the other gateway takes it over, completes it, and goes on with its events where the first stopped.
    rid = seen[0].response.id
    done = wait_for(lambda: _ended(second, rid), 60, what="the response taken over and ended")
    assert (done.status, done.output_text) == (reference.status, reference.output_text)
    rest = list(second.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    assert [e.sequence_number for e in rest] == list(range(len(seen), len(seen) + len(rest)))
    assert rest[-1].type == f"response.{done.status}" and _deltas(seen) + _deltas(rest) == done.output_text
    assert {e.item_id for e in seen + rest if hasattr(e, "item_id")} == {done.output[0].id}  # one message, one id
    r = redis.Redis.from_url(c.redis.url)
    assert r.hget(Names(c.ns).layer(rid.removeprefix("resp_"), "meta"), "state") == b"FINISHED"  # never cancelled


def test_a_background_response_outlives_a_graceful_stop_of_its_gateway(start_cluster):
    c = start_cluster(env={**FAST, **SIM, "CONVEYOR_SHUTDOWN_GRACE_S": "1"})  # a grace shorter than the response
    other = f"http://127.0.0.1:{free_port()}"
    c.start_service("gateway2", {"CONVEYOR_PORT": other.rsplit(":", 1)[1]})
    wait_for(lambda: _ready(other), 120, what="the second gateway")
    first, second = openai_client(c.url), openai_client(other)
    resp = first.responses.create(model=MODEL, input="Count to a thousand", background=True, max_output_tokens=120)
    wait_for(lambda: second.responses.retrieve(resp.id).status == "in_progress", 30, what="the response running")
    c.procs["gateway"].send_signal(signal.SIGTERM)  # its drain leaves the background response to another gateway
    assert c.procs["gateway"].wait(60) == 0
    done = wait_for(lambda: _ended(second, resp.id), 60, what="the response taken over and ended")
    assert done.status in ("completed", "incomplete") and done.output_text
    rid = resp.id.removeprefix("resp_")
    r = redis.Redis.from_url(c.redis.url)
    assert r.hget(Names(c.ns).layer(rid, "meta"), "state") == b"FINISHED"  # never cancelled
