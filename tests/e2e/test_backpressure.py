"""Back-pressure: beyond the cluster-wide waiting bound a request gets 429 at once and is never created;
every accepted request finishes. The gateway also bounds the requests it serves at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import redis

from shared.wire.constants import Names
from shared.process.liveness import read_live
from tests.support.cluster import Cluster, cluster_fixture
from tests.support.cache import CACHE_DIR
from tests.support.openai_fixtures import MODEL, async_openai_client
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

BOUND = 4
BLOCKER_TOKENS = 64  # keeps the only sequence slot busy while the others arrive


# One worker that runs one sequence at a time and takes no more: everything else waits in the queue.
slow = cluster_fixture(
    "slow",
    env={**SIM, "CONVEYOR_MAX_NUM_SEQS": "1", "CONVEYOR_QUEUE_SLACK": "0", "CONVEYOR_MAX_WAITING_REQUESTS": str(BOUND)},
)


def _worker_running(cluster) -> bool:
    r = redis.Redis.from_url(cluster.redis.url)
    return any(w["running"] == 1 for w in read_live(r, Names(cluster.ns), "worker").values())


def test_requests_beyond_the_waiting_bound_get_429_at_once_and_accepted_ones_finish(slow):
    r = redis.Redis.from_url(slow.redis.url)
    created_before = r.zcard(Names(slow.ns).requests_index(0))

    async def run():
        client = async_openai_client(slow.url)
        blocker = asyncio.create_task(
            client.completions.create(
                model=MODEL,
                prompt="Count to a hundred:",
                max_tokens=BLOCKER_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        await asyncio.to_thread(wait_for, lambda: _worker_running(slow), 60, 0.05, "the blocker is running")

        async def one(i: int):
            t0 = time.monotonic()
            try:
                out = await client.completions.create(
                    model=MODEL, prompt=f"Number {i}:", max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
                )
            except openai.RateLimitError as e:
                return e, time.monotonic() - t0, blocker.done()
            return out, time.monotonic() - t0, blocker.done()

        others = await asyncio.gather(*[one(i) for i in range(2 * BOUND)])
        return await blocker, others

    blocker, others = asyncio.run(run())
    refused = [(e, dt, blocker_done) for e, dt, blocker_done in others if isinstance(e, openai.RateLimitError)]
    served = [out for out, _, _ in others if not isinstance(out, openai.RateLimitError)]
    assert len(served) == BOUND and len(refused) == BOUND
    for e, dt, blocker_done in refused:
        assert not blocker_done and dt < 10  # answered while the queue was full, not after waiting for a slot
        assert e.response.headers["retry-after"] == "1" and e.code == "overloaded"
    assert blocker.choices[0].finish_reason == "length"
    assert all(out.choices[0].finish_reason == "length" for out in served)
    assert r.zcard(Names(slow.ns).requests_index(0)) - created_before == 1 + BOUND  # the refused were never created
    assert r.zcard(Names(slow.ns).waiting(0)) == 0


def test_request_while_no_worker_is_live_gets_503_at_once_and_is_never_created(tmp_path, model_dir):
    c = Cluster(tmp_path, CACHE_DIR)
    try:
        c.redis.start()
        c.env["CONVEYOR_REDIS_URL"] = c.redis.url
        for name in ("tokenizer", "scheduler", "gateway"):  # no worker
            c.start_service(name)

        def tokenizer_live() -> bool:
            try:
                return httpx.get(f"{c.url}/ready", timeout=2).json()["error"]["live"]["tokenizer"] == 1
            except (httpx.HTTPError, KeyError, ValueError):
                return False

        wait_for(tokenizer_live, 120, 0.2, what="gateway up, tokenizer live")
        t0 = time.monotonic()
        r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and time.monotonic() - t0 < 5
        assert r.json()["error"]["code"] == "not_ready" and "worker" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        assert redis.Redis.from_url(c.redis.url).zcard(Names(c.ns).requests_index(0)) == 0
    finally:
        c.stop()


def test_a_request_that_cannot_start_before_its_timeout_gets_429_at_once_not_504_later(slow):
    """The queue's work model says the request would wait longer than its timeout: refused now, with a Retry-After
    from the predicted wait (issue 24, item 11), instead of held for its whole timeout and then refused."""

    async def run():
        client = async_openai_client(slow.url)
        blocker = asyncio.create_task(
            client.completions.create(
                model=MODEL,
                prompt="Count to a thousand:",
                max_tokens=3000,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        await asyncio.to_thread(wait_for, lambda: _worker_running(slow), 60, 0.05, "the blocker is running")
        t0 = time.monotonic()
        try:
            await client.completions.create(
                model=MODEL, prompt="Late", max_tokens=2, temperature=0, extra_body={"timeout": 5}
            )
            got = None
        except openai.RateLimitError as e:
            got = e
        took = time.monotonic() - t0
        blocker.cancel()
        return got, took

    got, took = asyncio.run(run())
    assert got is not None and got.code == "overloaded", got
    assert int(got.response.headers["retry-after"]) > 5 and took < 5  # answered before its timeout passed
