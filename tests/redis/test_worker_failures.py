"""A placement the worker cannot take fails at once, alone, with a reason its client is told (issue 24, item 6):
never left pending on the worker's stream with the request SCHEDULED until its cap. The worker's real code
(simulated engine) and the scheduler's real placement, on a test's own Redis."""

from __future__ import annotations

import pytest

from shared.wire.constants import EVENT_FIELD, GROUP_WORKER
from shared.wire.events import Constraint, Failed, Sampling, decode
from shared.text.grammar import ANY_OBJECT, KIND_JSON_SCHEMA
from tests.support.scheduling import delivered_tokens, place, sim_worker, state

JSON_OUT = Sampling(max_tokens=4, temperature=0.0, constraint=Constraint(kind=KIND_JSON_SCHEMA, spec=ANY_OBJECT))


@pytest.fixture
def worker(redis_server, names, model_dir):
    return sim_worker(redis_server, names)


def _told(redis_client, names, rid: str) -> list:
    return [
        e
        for _, f in redis_client.xrange(names.reply_stream("gw1"))
        if isinstance(e := decode(f[EVENT_FIELD]), Failed) and e.request_id == rid
    ]


def test_a_placement_whose_admission_raises_fails_at_once_and_alone(
    worker, redis_server, redis_client, names, tmp_path
):
    # llguidance failing on the first constrained request: here the tokenizer file it is built from is unreadable
    # to it (it raises ValueError, not one of the engine's own refusals).
    broken = tmp_path / "tokenizer.json"
    broken.write_text("not a tokenizer")
    worker.engine.structured.tokenizer_file = broken
    constrained, plain = place(redis_server, names, JSON_OUT, Sampling(max_tokens=4, temperature=0.0))
    worker.tick()
    assert state(redis_client, names, constrained) == "FAILED"  # (was: SCHEDULED, until its cap)
    assert redis_client.hget(names.layer(constrained, "meta"), "reason") == b"worker_error"
    [failed] = _told(redis_client, names, constrained)
    assert failed.reason == "worker_error" and "ValueError" in failed.message and failed.service == "worker"
    assert redis_client.xpending(worker.stream, GROUP_WORKER)["pending"] == 0  # (was: 1, for ever)
    assert set(worker.active) == {plain}  # its batch-mate runs
    while worker.engine.has_unfinished():
        worker.tick()
    assert state(redis_client, names, plain) == "FINISHED"


def test_placements_left_unacknowledged_by_a_redis_error_are_read_again(
    worker, redis_server, redis_client, names, monkeypatch
):
    """A Redis error in the middle of the worker's dispatch (here: failing a request it refused) leaves what it
    read unacknowledged; its next tick takes those entries up again, and runs no finished one twice."""
    import redis

    bad = Sampling(max_tokens=4, temperature=0.0, stop_token_ids=(10**9,))  # refused by the engine: out of vocab
    refused, plain = place(redis_server, names, bad, Sampling(max_tokens=4, temperature=0.0))
    transition = worker.lifecycle.transition
    calls = {"n": 0}

    def flaky(*a, **kw):  # Redis refuses the first write (a failover: READONLY), then is back
        calls["n"] += 1
        if calls["n"] == 1:
            raise redis.ReadOnlyError("READONLY You can't write against a read only replica.")
        return transition(*a, **kw)

    monkeypatch.setattr(worker.lifecycle, "transition", flaky)
    with pytest.raises(redis.ReadOnlyError):
        worker.tick()  # run_loop backs off and calls tick again
    worker.tick()
    assert state(redis_client, names, refused) == "FAILED"  # (was: SCHEDULED until its cap)
    assert set(worker.active) == {plain}  # (was: never admitted, SCHEDULED until its cap)
    while worker.engine.has_unfinished():
        worker.tick()
    assert state(redis_client, names, plain) == "FINISHED"
    assert redis_client.xpending(worker.stream, GROUP_WORKER)["pending"] == 0
    worker.tick()  # nothing is taken up twice
    assert not worker.active and not worker.engine.has_unfinished()


@pytest.mark.parametrize("fault", ["oom", "readonly"])
def test_a_step_whose_publish_redis_refuses_is_published_once_redis_accepts_again(
    worker, redis_server, redis_client, names, fault
):
    """Redis answering a step's writes with an error reply -- OOM under noeviction, READONLY while a replica is
    being promoted -- is not a lost step (issue 24, item 5): the step is published when Redis takes writes again,
    so the tokens list holds every token the client got, once, and the request finishes."""
    import threading

    import redis

    (rid,) = place(redis_server, names, Sampling(max_tokens=8, temperature=0.0, ignore_eos=True))
    while not redis_client.llen(names.tokens(rid)):
        worker.tick()
    if fault == "oom":
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.config_set("maxmemory", 1)
        heal = threading.Timer(1.0, lambda: redis_client.config_set("maxmemory", 0))
    else:  # a replica of nobody that accepts nothing written; promoted back after 1 s
        redis_client.config_set("replica-read-only", "yes")
        redis_client.replicaof("127.0.0.1", 1)
        heal = threading.Timer(1.0, lambda: redis_client.replicaof("NO", "ONE"))
    heal.start()
    try:
        while worker.engine.has_unfinished() or worker.active:
            try:
                worker.tick()
            except redis.RedisError:  # what run_loop does: back off, tick again
                heal.join(0.1)
    finally:
        heal.join()
    tokens = [int(t) for t in redis_client.lrange(names.tokens(rid), 0, -1)]
    assert len(tokens) == 8 and tokens == delivered_tokens(redis_client, names, rid)
    assert state(redis_client, names, rid) == "FINISHED"
