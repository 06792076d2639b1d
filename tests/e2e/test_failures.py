"""Failure paths: poison events, one request failing inside a batch, metrics that agree with history."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import redis
import redis.asyncio as aioredis

from shared.process import liveness
from shared.wire.constants import Names
from shared.state.context_store import ContextStore
from shared.wire.constants import EVENT_FIELD
from shared.wire.events import SCHEMA_VERSION, RequestReceived, Sampling, Scheduled, decode, encode
from shared.state.lifecycle import Lifecycle, Owner, State
from tests.support.waiting import wait_for
from tests.support.metrics import scrape


def _context(cluster, reply_to: str, event, stream: str | None = None) -> str:
    """Create a request's context and publish `event` the way a gateway does."""
    names = Names(cluster.ns)

    async def create():
        client = aioredis.Redis.from_url(cluster.redis.url)
        await ContextStore(client, names, 60).acreate(
            event.request_id, {"reply_to": reply_to}, {}, event, stream=stream or ""
        )
        await client.aclose()

    asyncio.run(create())
    return event.request_id


def _received(reply_to: str, **kw) -> RequestReceived:
    now = time.time()
    return RequestReceived(
        request_id=uuid.uuid4().hex,
        reply_to=reply_to,
        prompt="Hi",
        sampling=Sampling(max_tokens=3),
        deadline=now + 60,
        received_at=now,
        **kw,
    )


def test_poison_event_goes_to_dead_letter_and_fails_its_request(cluster):
    r = redis.Redis.from_url(cluster.redis.url)
    names = Names(cluster.ns)
    reply = f"{cluster.ns}:stream:reply:test-{uuid.uuid4().hex[:6]}"
    # A producer of a newer, unknown schema: no consumer can read it.
    rid = _context(cluster, reply, _received(reply, schema_version=SCHEMA_VERSION + 98))
    wait_for(lambda: r.xlen(reply) > 0, 30, what="failure reported to the reply stream")
    failed = decode(r.xrange(reply)[0][1][b"e"])
    assert failed.request_id == rid and failed.reason == "internal" and "poison" in failed.message
    dead = [e for _, e in r.xrange(names.dead_letter_stream) if e[b"stream"] == names.received_stream(0).encode()]
    assert dead, "no dead-letter entry"
    meta = r.hgetall(names.layer(rid, "meta"))
    assert meta[b"state"] == b"FAILED" and meta[b"reason"] == b"internal"
    assert r.xpending(names.received_stream(0), "tokenizer")["pending"] == 0
    ok = httpx.post(f"{cluster.url}/generate", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the group is not blocked


def test_worker_error_for_one_request_leaves_the_batch_running(cluster):
    r = redis.Redis.from_url(cluster.redis.url)
    names = Names(cluster.ns)
    worker = next(iter(liveness.read_live(r, names, "worker")))
    reply = f"{cluster.ns}:stream:reply:test-{uuid.uuid4().hex[:6]}"
    # A request placed by hand (acting as tokenizer and scheduler) whose prompt holds a token id outside
    # the vocabulary, as a buggy upstream would send it.
    rid = _context(cluster, reply, _received(reply), stream=f"{cluster.ns}:test:sink")
    lc = Lifecycle(r, names, "test", 60)
    for s in (State.PREPROCESSED, State.QUEUED):
        lc.transition(rid, s)
    lc.transition(rid, State.SCHEDULED, owner=Owner(worker, 1))  # as the scheduler places: attempt 1 on it
    bad = Scheduled(
        request_id=rid,
        worker_id=worker,
        reply_to=reply,
        prompt_token_ids=(1, 10**9),
        sampling=Sampling(max_tokens=3),
        priority=0,
        deadline=time.time() + 60,
    )
    box: dict = {}

    async def batch():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as c:
            return await asyncio.gather(
                *[
                    c.post("/generate", json={"prompt": f"Story {i}:", "max_tokens": 24, "ignore_eos": True})
                    for i in range(4)
                ]
            )

    t = threading.Thread(target=lambda: box.update(r=asyncio.run(batch())))
    t.start()
    wait_for(
        lambda: httpx.get(f"{cluster.url}/v1/requests", params={"state": "DECODING"}).json()["data"],
        60,
        what="the batch decoding",
    )
    r.xadd(names.worker_stream(worker), {EVENT_FIELD: encode(bad)})
    wait_for(lambda: r.xlen(reply) > 0, 30, what="the failure reported")
    failed = decode(r.xrange(reply)[0][1][EVENT_FIELD])
    assert failed.request_id == rid and failed.reason == "worker_error" and "outside" in failed.message
    t.join(180)
    assert [x.status_code for x in box["r"]] == [200] * 4
    assert all(len(x.json()["token_ids"]) == 24 for x in box["r"])
    assert r.hget(names.layer(rid, "meta"), "state") == b"FAILED"


def test_metrics_agree_with_history_and_counters_move_once(cluster):
    before = scrape(cluster.url)
    outs = [
        httpx.post(
            f"{cluster.url}/generate",
            json={"prompt": f"Tell me about {w}.", "max_tokens": 8, "ignore_eos": True},
            timeout=60,
        ).json()
        for w in ("cats", "dogs", "owls")
    ]
    after = scrape(cluster.url)
    key = 'conveyor:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 3
    assert after["conveyor:generation_tokens_total"] - before.get("conveyor:generation_tokens_total", 0) == 24
    assert (
        after["conveyor:e2e_request_latency_seconds_count"]
        - before.get("conveyor:e2e_request_latency_seconds_count", 0)
        == 3
    )
    for name in (
        "conveyor:num_requests_running",
        "conveyor:num_requests_waiting",
        "conveyor:kv_cache_usage_perc",
        "conveyor:prefix_cache_queries_total",
        'conveyor:num_requests_in_state{state="QUEUED"}',
    ):
        assert name in after, name
    for out in outs:
        hist = {
            h["state"]: h["t"] for h in httpx.get(f"{cluster.url}/v1/requests/{out['request_id']}").json()["history"]
        }
        m = out["metrics"]
        assert abs(m["queue_wait"] - (hist["SCHEDULED"] - hist["QUEUED"])) < 1e-6
        assert abs(m["engine_ttft"] - (hist["DECODING"] - hist["SCHEDULED"])) < 1e-6
        assert abs(m["prefill_time"] - (hist["DECODING"] - hist["PREFILLING"])) < 1e-6
        assert abs(m["decode_time"] - (hist["FINISHED"] - hist["DECODING"])) < 1e-6
        # Client-side intervals (gateway clock) contain the lifecycle ones (Redis clock, same host).
        assert m["ttft"] >= hist["DECODING"] - hist["RECEIVED"] - 0.05
        assert m["e2e"] >= hist["FINISHED"] - hist["RECEIVED"] - 0.05
        assert m["output_tokens"] == 8 and m["prompt_tokens"] > 0 and m["preemptions"] == 0
        assert 0 <= m["itl_p50"] <= m["itl_max"] and m["tpot"] > 0


def test_listing_shows_live_requests_by_state(cluster):
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(
            r=httpx.post(
                f"{cluster.url}/generate",
                json={"prompt": "List me", "max_tokens": 400, "ignore_eos": True},
                timeout=120,
            )
        )
    )
    t.start()
    page = wait_for(
        lambda: httpx.get(f"{cluster.url}/v1/requests", params={"state": "DECODING"}).json()["data"],
        60,
        what="a DECODING request listed",
    )
    assert page[0]["state"] == "DECODING" and page[0]["input"]["prompt"] == "List me"
    httpx.delete(f"{cluster.url}/v1/requests/{page[0]['request_id']}")
    t.join(60)
    bad = httpx.get(f"{cluster.url}/v1/requests", params={"state": "NOPE"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.state"
