"""Nothing the worker writes about a request overtakes the step's publish that carries its tokens: a timeout, a
hand-back on drain, a request placed elsewhere -- even with that publish slow (a slow Redis). Guards for any
change that moves the publish off the step's critical path (tried on 2026-12-07: docs/benchmarks.md). The
worker's real code (simulated engine), the scheduler's real placement, on a test's own Redis."""

from __future__ import annotations

import time

import pytest

from shared.wire.constants import EVENT_FIELD
from shared.wire.events import Sampling, TimedOut, TokenGenerated, decode
from tests.support.scheduling import (
    delivered_tokens,
    heartbeat,
    place,
    preprocessed_request,
    deliver,
    scheduled_on,
    scheduler,
    sim_worker,
    state,
    WORKER,
)

LONG = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture
def worker(redis_server, names, model_dir):
    return sim_worker(redis_server, names)


def _told(redis_client, names, rid: str) -> list:
    """The events the request's gateway got for it, in order: each step's token list, anything else by type."""
    out = []
    for _, f in redis_client.xrange(names.reply_stream("gw1")):
        ev = decode(f[EVENT_FIELD])
        if isinstance(ev, TokenGenerated):
            out += [list(i.token_ids) for i in ev.items if i.request_id == rid]
        elif getattr(ev, "request_id", None) == rid:
            out.append(type(ev))
    return out


def _stored(redis_client, names, rid: str) -> list[int]:
    return [int(t) for t in redis_client.lrange(names.tokens(rid), 0, -1)]


def _slowed(worker, monkeypatch, seconds: float) -> None:
    """Every publish from now on takes `seconds` longer: a slow Redis (for a publish run beside the next step,
    still in flight when the worker's next tick runs)."""
    publish = worker.publisher.publish

    def slow(*a, **kw):
        time.sleep(seconds)
        return publish(*a, **kw)

    monkeypatch.setattr(worker.publisher, "publish", slow)


def test_a_finished_request_is_forgotten_once_its_last_step_is_published(worker, redis_server, redis_client, names):
    (rid,) = place(redis_server, names, Sampling(max_tokens=3, temperature=0.0, ignore_eos=True))
    worker.tick()
    while worker.engine.has_unfinished():
        worker.tick()
    assert not worker.active
    assert state(redis_client, names, rid) == "FINISHED"
    assert _told(redis_client, names, rid)[-1].__name__ == "Completed"


def _generating(worker, redis_server, redis_client, names) -> str:
    """A long request placed on the worker, ticked until its first tokens are published."""
    (rid,) = place(redis_server, names, LONG)
    while not redis_client.llen(names.tokens(rid)):
        worker.tick()
    return rid


def test_a_timed_out_request_gets_its_last_steps_tokens_before_its_timeout(
    worker, redis_server, redis_client, names, monkeypatch
):
    rid = _generating(worker, redis_server, redis_client, names)
    _slowed(worker, monkeypatch, 0.3)
    worker.tick()
    worker.active[rid].deadline = time.time() - 1
    worker.tick()  # the deadline found passed
    told = _told(redis_client, names, rid)
    assert told[-1] is TimedOut
    assert state(redis_client, names, rid) == "TIMED_OUT"
    assert _stored(redis_client, names, rid) == delivered_tokens(redis_client, names, rid)
    assert rid not in worker.active and not worker.engine.has_unfinished()


def test_a_request_placed_elsewhere_gets_no_tokens_after_its_move(worker, redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names, sampling=LONG)
    deliver(s, names.preprocessed_stream(0), ev)
    s.place()
    rid = ev.request_id
    while not redis_client.llen(names.tokens(rid)):
        worker.tick()
    s.requeue(scheduled_on(redis_client, names)[0], (), "worker_lost")  # the scheduler gave up on this worker
    s.on_heartbeat(heartbeat("w2"))
    s.workers.pop(WORKER)
    s.place()
    before = _stored(redis_client, names, rid)
    for _ in range(20):  # the next step's publish finds it moved
        worker.tick()
        if rid not in worker.active:
            break
    assert rid not in worker.active
    assert not worker.engine.has_unfinished()  # dropped from the engine too
    assert _stored(redis_client, names, rid) == before
    assert delivered_tokens(redis_client, names, rid) == before
    for _ in range(3):
        worker.tick()
    assert _stored(redis_client, names, rid) == before


def test_a_draining_worker_hands_back_every_token_it_published(worker, redis_server, redis_client, names, monkeypatch):
    from shared.wire.events import HandBack

    rid = _generating(worker, redis_server, redis_client, names)
    _slowed(worker, monkeypatch, 0.2)
    worker.tick()
    monkeypatch.setattr(worker.s, "drain_timeout_s", 0.0)
    worker.beats.start()  # as run() does before its loop
    worker.drain()
    (back,) = [
        e
        for _, f in redis_client.xrange(names.control_stream)
        if isinstance(e := decode(f[EVENT_FIELD]), HandBack) and e.request_id == rid
    ]
    assert (
        list(back.output_token_ids) == _stored(redis_client, names, rid) == delivered_tokens(redis_client, names, rid)
    )
