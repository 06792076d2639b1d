"""The context janitor under sustained load (issue 24, items 1 and 3): the cap on ended contexts and the TTL path
cost round trips per batch, never per context, keep up with any ending rate, run off the scheduler's tick, and
requests whose context expired before they ended stop counting against the admission bounds."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from shared.state.context_store import ContextStore, WaitingBounds, WaitingFull
from shared.state.janitor import ContextJanitor, JanitorLoop
from shared.state.lifecycle import Lifecycle, State
from tests.support.factories import request_received
from tests.redis.test_round_trips import RoundTrips
from tests.support.waiting import wait_for

ENDINGS = (State.FAILED, State.CANCELLED, State.TIMED_OUT)  # the terminal states a RECEIVED request can reach


def create(client, names, n: int, owner: str = "", live_ttl_s: int = 3600) -> list[str]:
    """n requests created by the gateway's script, in pipelines (thousands in well under a second)."""
    store, ids = ContextStore(client, names, live_ttl_s), []
    for start in range(0, n, 500):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(500, n - start)):
            ev = request_received()
            keys, argv = store.create_args(ev.request_id, {"owner": owner} if owner else {}, {"prompt": "p"}, ev)
            store._create(keys=keys, args=argv, client=pipe)
            ids.append(ev.request_id)
        pipe.execute()
    return ids


def end(client, names, ids: list[str], states=(State.CANCELLED,), ttl_s: int = 3600) -> None:
    """End the requests in order (ids[i] in states[i % len(states)]), each at its own Redis time."""
    lc = Lifecycle(client, names, "test", ttl_s)
    for start in range(0, len(ids), 500):
        pipe = client.pipeline(transaction=False)
        for i, rid in enumerate(ids[start : start + 500], start):
            lc.queue(pipe, rid, states[i % len(states)], "test")
        pipe.execute()


def ended_left(client, names) -> int:
    return sum(client.zcard(names.state_set(0, s.value)) for s in ENDINGS)


def test_the_cap_is_enforced_in_round_trips_per_batch_not_per_context(redis_client, names, monkeypatch):
    ids = create(redis_client, names, 600)
    end(redis_client, names, ids)
    with RoundTrips(monkeypatch) as trips:
        removed = ContextJanitor(redis_client, names, 3600, cap=100).sweep(time.time(), batch=100)
    assert removed == 500 and ended_left(redis_client, names) == 100
    assert trips.n <= 4 * (500 // 100) + 4, f"{trips.n} round trips to delete 500 contexts"


def test_the_cap_deletes_the_oldest_ended_contexts_whatever_their_state(redis_client, names):
    ids = create(redis_client, names, 40)
    end(redis_client, names, ids, ENDINGS)  # interleaved: every batch merges the three sets by end time
    ContextJanitor(redis_client, names, 3600, cap=10).sweep(time.time(), batch=4)
    assert [rid for rid in ids if redis_client.exists(names.layer(rid, "meta"))] == ids[-10:]
    assert ended_left(redis_client, names) == 10


def test_one_sweep_forgets_every_expired_ended_context_however_many(redis_client, names):
    ids = create(redis_client, names, 250)
    end(redis_client, names, ids, ENDINGS, ttl_s=1)
    removed = ContextJanitor(redis_client, names, 1, cap=100_000).sweep(time.time() + 2, batch=50)
    assert removed == 250 and ended_left(redis_client, names) == 0
    assert redis_client.zcard(names.requests_index(0)) == 0


def test_a_janitor_loop_behind_its_work_sweeps_again_without_waiting_its_interval(redis_client, names):
    ids = create(redis_client, names, 120)
    end(redis_client, names, ids)
    janitor = ContextJanitor(redis_client, names, 3600, cap=20, batch=10, max_batches=2)  # 20 a sweep at most
    loop = JanitorLoop(janitor, interval_s=3600)
    loop.start()
    try:
        wait_for(lambda: ended_left(redis_client, names) == 20, 10, what="the cap reached by sweeps in a row")
    finally:
        loop.stop()


def test_the_janitor_loop_survives_a_sweep_that_raises(redis_client, names):
    ids = create(redis_client, names, 30)
    end(redis_client, names, ids)
    janitor, failures = ContextJanitor(redis_client, names, 3600, cap=10), []
    sweep = janitor.sweep

    def flaky(now: float) -> int:
        if not failures:
            failures.append(now)
            raise RuntimeError("a sweep that fails once")
        return sweep(now)

    janitor.sweep = flaky
    loop = JanitorLoop(janitor, interval_s=0.05)
    loop.start()
    try:
        wait_for(lambda: ended_left(redis_client, names) == 10, 10, what="a sweep after the failed one")
    finally:
        loop.stop()
    assert len(failures) == 1


def _expire(redis_client, ids: list[str], names) -> None:
    wait_for(
        lambda: not any(redis_client.exists(names.layer(rid, "meta")) for rid in ids), 10, what="the contexts expired"
    )


def _admit(redis_server, names, bounds: WaitingBounds, owner: str = "") -> None:
    async def run():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            ev = request_received()
            await ContextStore(client, names, 60).acreate(
                ev.request_id, {"owner": owner} if owner else {}, {"prompt": "p"}, ev, bounds
            )
        finally:
            await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("bound", ["total", "per_owner"])
def test_a_request_whose_context_expired_before_it_ended_stops_counting_against_the_waiting_bounds(
    redis_server, redis_client, names, bound
):
    ghosts = create(redis_client, names, 3, owner="key1", live_ttl_s=1)  # their gateway and pipeline died
    _expire(redis_client, ghosts, names)
    ContextJanitor(redis_client, names, 1, cap=100).sweep(time.time() + 1)
    _admit(redis_server, names, WaitingBounds(**{bound: 1}), owner="key1")  # WaitingFull while they count


def test_a_request_whose_context_expired_on_a_worker_is_dropped_from_its_state_and_the_listing(redis_client, names):
    [rid] = create(redis_client, names, 1, owner="key1", live_ttl_s=1)
    lc = Lifecycle(redis_client, names, "test", 60)
    for s in (State.PREPROCESSED, State.QUEUED, State.SCHEDULED):
        lc.transition(rid, s)
    _expire(redis_client, [rid], names)
    ContextJanitor(redis_client, names, 1, cap=100).sweep(time.time() + 1)
    assert redis_client.zcard(names.state_set(0, "SCHEDULED")) == 0
    assert redis_client.zcard(names.requests_index(0)) == 0
    assert redis_client.zcard(names.owner_index(0, "key1")) == 0 and not redis_client.hlen(names.request_owners(0))


def test_a_live_request_older_than_the_ended_contexts_ttl_keeps_its_place(redis_server, redis_client, names):
    [rid] = create(redis_client, names, 1, owner="key1", live_ttl_s=3600)
    ContextJanitor(redis_client, names, 1, cap=100).sweep(time.time() + 5)  # older than the TTL, still alive
    assert redis_client.zscore(names.waiting(0), rid) is not None
    with pytest.raises(WaitingFull):
        _admit(redis_server, names, WaitingBounds(per_owner=1), owner="key1")
