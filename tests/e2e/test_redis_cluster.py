"""Conveyor on a real Redis Cluster: 3 masters with a replica each on loopback ports (support/redis_cluster.py), the
four real services started with CONVEYOR_REDIS_CLUSTER=true and ONE node's URL, the real model.

Skipped, saying why, where no redis-server / redis-cli can be found (make test installs Debian's redis-server and
redis-tools when they are missing)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading

import httpx
import pytest
from redis.cluster import RedisCluster

from shared.wire.constants import CLUSTER_PARTITIONS, Names
from shared.state.context_store import ContextStore
from shared.wire.errors import FatalError
from shared.state.lifecycle import Lifecycle, State
from shared.process.liveness import read_live
from tests.support.cluster import Cluster
from tests.support.cache import CACHE_DIR
from tests.support.waiting import wait_for

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"prompt": "The quick brown fox"},
    {"prompt": "def fibonacci(n):"},
    {"prompt": "Once upon a time, in a land far away,"},
    {"prompt": "The three laws of robotics are"},
]


def _start(tmp_path_factory, name: str):
    from tests.support.redis_cluster import LocalRedisCluster

    try:
        LocalRedisCluster.binaries()
    except FatalError as e:
        pytest.skip(f"no Redis Cluster for this test: {e}")
    rc = LocalRedisCluster(tmp_path_factory.mktemp(f"{name}-redis")).start()
    try:
        c = Cluster(tmp_path_factory.mktemp(name), CACHE_DIR, redis_url=rc.url, redis_cluster=True).start()
    except BaseException:
        rc.stop()
        raise
    return rc, c


@pytest.fixture(scope="module")
def on_cluster(tmp_path_factory, model_dir):
    rc, c = _start(tmp_path_factory, "on-cluster")
    yield rc, c
    c.stop()
    rc.stop()


def _names(c: Cluster) -> Names:
    return Names(c.ns, CLUSTER_PARTITIONS, cluster=True)


LONGEST = 64  # the module's longest greedy request (the master kill's)


def _expected(hf_reference, body: dict, max_tokens: int) -> list[int]:
    """transformers' greedy tokens, asked at the module's longest length whatever max_tokens is: each prompt's
    continuation is computed once, the shorter asks being its first tokens (tests/support/references.py)."""
    ids = hf_reference.prompt_ids(body.get("prompt"), body.get("messages"))
    return hf_reference(ids, LONGEST)[:max_tokens]


async def _stream(client: httpx.AsyncClient, body: dict, first_token: threading.Event | None = None) -> dict:
    """A streamed /generate: its token ids in order, its request id, and its last event."""
    ids, rid, last = [], None, None
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            rid = rid or last.get("request_id")
            ids += last.get("token_ids") or []
            if ids and first_token is not None:
                first_token.set()
    return {"token_ids": ids, "request_id": rid, "last": last}


def test_greedy_outputs_on_a_redis_cluster_equal_transformers_streamed_and_whole(on_cluster, hf_reference):
    _rc, c = on_cluster
    bodies = [{**b, "max_tokens": 24, "temperature": 0} for b in PROMPTS]

    async def run():
        async with httpx.AsyncClient(base_url=c.url, timeout=180) as client:
            whole = await asyncio.gather(*[client.post("/generate", json=b) for b in bodies])
            streamed = await asyncio.gather(*[_stream(client, b) for b in bodies])
        return whole, streamed

    whole, streamed = asyncio.run(run())
    for body, w, s in zip(bodies, whole, streamed):
        assert w.status_code == 200, w.text
        expected = _expected(hf_reference, body, 24)
        assert w.json()["token_ids"] == expected, body
        assert s["token_ids"] == expected, body


def test_requests_spread_over_every_master(on_cluster):
    """Requests (their keys, the partitions' indexes and streams) land on every master, not one. Ids are random: 12
    of them missed one master 2 % of the time (3 x (2/3)^12), so requests are sent until every master has one, at
    most 60 (a miss then: 3 x (2/3)^60, never)."""
    rc, c = on_cluster
    names = _names(c)
    ids: list[str] = []
    masters: set[int] = set()
    while len(ids) < 60 and (len(masters) < 3 or len(ids) < 12):
        body = {"prompt": f"Count to {len(ids)}:", "max_tokens": 2}
        ids.append(httpx.post(f"{c.url}/generate", json=body, timeout=120).json()["request_id"])
        masters.add(rc.master_for_key(names.layer(ids[-1], "meta")).port)
    assert len({names.partition(rid) for rid in ids}) > 3
    assert len(masters) == 3, masters
    for node in (n for n in rc.nodes if n.is_master()):
        assert any(k.startswith(c.ns.encode()) for k in node.client.keys(f"{c.ns}:*")), node.port


def test_listing_metrics_and_cancel_read_every_partition(on_cluster):
    rc, c = on_cluster
    done = [
        httpx.post(f"{c.url}/generate", json={"prompt": f"Say {i}", "max_tokens": 2}, timeout=120).json()["request_id"]
        for i in range(6)
    ]
    listed = {
        r["request_id"]
        for r in httpx.get(f"{c.url}/v1/requests", params={"state": "FINISHED", "limit": 100}, timeout=30).json()[
            "data"
        ]
    }
    assert set(done) <= listed
    box: dict = {}

    async def long_one():
        async with httpx.AsyncClient(base_url=c.url, timeout=180) as client:
            box["r"] = await client.post(
                "/generate", json={"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": True}
            )

    t = threading.Thread(target=lambda: asyncio.run(long_one()))
    t.start()
    wait_for(
        lambda: httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}, timeout=30).json()["data"],
        120,
        what="a request decoding",
    )
    rid = httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}, timeout=30).json()["data"][0]["request_id"]
    assert httpx.delete(f"{c.url}/v1/requests/{rid}", timeout=30).status_code == 200
    t.join(timeout=120)
    assert box["r"].status_code == 499, box["r"].text
    gauges = [
        line
        for line in httpx.get(f"{c.url}/metrics", timeout=30).text.splitlines()
        if line.startswith("conveyor:num_requests_waiting ")
    ]
    assert gauges == ["conveyor:num_requests_waiting 0.0"]  # the sum of every partition's waiting set


def test_tokens_and_ending_a_dead_worker_never_published_reach_the_client_from_the_context(on_cluster):
    """On a cluster a worker commits a partition's tokens and transitions, then publishes to the reply stream.
    Dying in between (acted here: the worker frozen, its last step written by the test, then killed) leaves the
    client's stream silent: the gateway reads the tokens from the list and builds the ending from the context."""
    _rc, c = on_cluster
    r, names = c.client(), _names(c)
    started, box = threading.Event(), {}

    async def run():
        async with httpx.AsyncClient(base_url=c.url, timeout=120) as client:
            box["out"] = await _stream(
                client, {"prompt": "Tell a long story.", "max_tokens": 500, "ignore_eos": True}, started
            )

    t = threading.Thread(target=lambda: asyncio.run(run()))
    t.start()
    wait_for(started.is_set, 120, what="the first token")
    worker = c.procs["worker0"]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        rid = httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}, timeout=30).json()["data"][0][
            "request_id"
        ]
        attempt = int(json.loads(r.hget(names.layer(rid, "exec"), "attempt")))
        r.rpush(names.tokens(rid), 7, 8, 9)  # the step the worker committed before it died
        tokens = [int(x) for x in r.lrange(names.tokens(rid), 0, -1)]
        ContextStore(r, names, 60).update(
            r, rid, "output", {"token_ids": tokens, "finish_reason": "length", "output_tokens": len(tokens)}
        )
        assert Lifecycle(r, names, "worker", 60).transition(rid, State.FINISHED, "length", fence=attempt).applied
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    t.join(timeout=60)
    c.start_service("worker0")  # the next tests' worker
    assert not t.is_alive(), "the stream never ended"
    assert box["out"]["token_ids"] == tokens
    assert box["out"]["last"].get("finish_reason") == "length", box["out"]["last"]
    wait_for(lambda: httpx.get(f"{c.url}/ready", timeout=5).status_code == 200, 120, what="a worker again")


@pytest.mark.timeout(600)  # a failover, six streams and transformers' references: minutes on a busy 2-core machine
def test_killing_a_master_mid_stream_loses_no_request_and_no_token(on_cluster, hf_reference):
    """SIGKILL of the master holding the gateway's reply stream while six greedy streams run: its replica is
    promoted, and every stream completes with exactly transformers' tokens (none missing, none repeated).
    Last in this module: the cluster it leaves has one master less on the spare replica, healthy again."""
    rc, c = on_cluster
    names = _names(c)
    plain = RedisCluster.from_url(rc.url)
    gateway = next(iter(read_live(plain, names, "gateway")))
    victim = rc.master_for_key(names.reply_stream(gateway))
    bodies = [{**b, "max_tokens": LONGEST, "temperature": 0} for b in PROMPTS]
    started = [threading.Event() for _ in bodies]
    box: dict = {}

    async def run():
        async with httpx.AsyncClient(base_url=c.url, timeout=240) as client:
            box["out"] = await asyncio.gather(
                *[_stream(client, b, e) for b, e in zip(bodies, started)], return_exceptions=True
            )

    t = threading.Thread(target=lambda: asyncio.run(run()))
    t.start()
    wait_for(lambda: all(e.is_set() for e in started), 180, what="every stream's first token")
    rc.kill(victim)
    rc.wait_promoted(victim, timeout=60)
    t.join(timeout=240)
    assert not t.is_alive(), "a stream never ended"
    for body, out in zip(bodies, box["out"]):
        assert not isinstance(out, BaseException), out
        assert out["token_ids"] == _expected(hf_reference, body, LONGEST), body
        assert out["last"].get("finish_reason") in ("stop", "length"), out["last"]
        snap = httpx.get(f"{c.url}/v1/requests/{out['request_id']}", timeout=30).json()
        assert snap["state"] == "FINISHED", snap["history"]
