"""Two processes settling one request at once: exactly one terminal state is applied and recorded (the lifecycle in
one process: tests/redis/test_lifecycle.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from shared.state.context_store import ContextStore
from shared.state.lifecycle import TERMINAL, Lifecycle, State
from tests.redis.test_lifecycle import _at


def _racer(url, ns, rid, state, barrier, results):
    import redis

    from shared.wire.constants import Names

    client = redis.Redis.from_url(url)
    lc = Lifecycle(client, Names(ns), f"racer-{state}", 60)
    barrier.wait()
    results.put((state, lc.transition(rid, State(state)).applied))


@pytest.mark.parametrize("round_", range(5))
def test_two_processes_settling_one_request_give_one_terminal_state(redis_server, redis_client, names, round_):
    _lc, rid = _at(redis_client, names, State.DECODING)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(redis_server.url, names.ns, rid, s, barrier, results))
        for s in ("FINISHED", "CANCELLED")
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    winners = [s for s, applied in outcomes if applied]
    assert len(winners) == 1
    snap = ContextStore(redis_client, names, 60).read(redis_client, rid)
    assert snap.state.value == winners[0]
    assert sum(1 for h in snap.history if State(h["state"]) in TERMINAL) == 1
