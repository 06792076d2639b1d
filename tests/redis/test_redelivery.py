"""The scheduler and the worker under redelivery, replicas and stale owners: every event delivered twice, every
write a stale owner could make, changes nothing the second time. Real Redis, real services' code, no model."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from services.scheduler.service import SchedulerService
from services.worker.engine.outputs import RequestOutput, StepResult
from services.worker.heartbeat import Heartbeater
from services.worker.publisher import Active
from shared.wire.events import CancelRequested, HandBack, decode
from shared.state.lifecycle import Lifecycle, Publish, State
from shared.process.runtime import Liveness
from tests.support.scheduling import (
    WORKER,
    deliver,
    heartbeat,
    placed,
    preprocessed_request,
    scheduled_on,
    scheduler,
    state,
    step_publisher,
)
from tests.support.waiting import wait_for


def test_redelivered_preprocessed_leaves_a_placed_request_where_it_is(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"
    deliver(s, names.preprocessed_stream(0), ev)  # the same event again
    s.place()
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"
    assert len(scheduled_on(redis_client, names)) == 1
    assert not redis_client.hexists(names.queue(0), ev.request_id)


def test_redelivered_hand_back_does_not_move_a_request_placed_again(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    first = scheduled_on(redis_client, names)[0]
    back = HandBack(
        request_id=ev.request_id, worker_id=WORKER, reason="shutdown", scheduled=first, output_token_ids=(7,)
    )
    deliver(s, names.control_stream, back)
    s.place()
    assert [e.attempt for e in scheduled_on(redis_client, names)] == [1, 2]
    deliver(s, names.control_stream, back)  # redelivered after the request was placed again
    s.place()
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"
    assert [e.attempt for e in scheduled_on(redis_client, names)] == [1, 2]
    assert redis_client.hget(names.layer(ev.request_id, "exec"), "attempt") == b"2"


def test_restarted_scheduler_queues_adaptive_requests_before_hearing_from_workers(redis_server, redis_client, names):
    placed(redis_server, names, scheduler(redis_server, names))  # leaves a stored placement on w1
    s = scheduler(redis_server, names)  # a restart: w1 is known only from the stored placement
    s.sync()
    ev = preprocessed_request(redis_server, names, adaptive=True)
    deliver(s, names.preprocessed_stream(0), ev)
    assert state(redis_client, names, ev.request_id) == "QUEUED"
    assert redis_client.hexists(names.queue(0), ev.request_id)  # acknowledged only after this was stored


def test_redis_outage_longer_than_the_liveness_ttl_loses_no_worker(redis_server, redis_client, names):
    s = scheduler(redis_server, names, liveness_ttl_s=1.0, heartbeat_interval_s=0.2, socket_timeout_s=0.5)
    beats = Heartbeater(
        redis.Redis.from_url(redis_server.url, socket_timeout=0.5), Liveness(names, "worker", WORKER, 0.2, 1.0)
    )
    beats.update(heartbeat())
    beats.start()
    gateway = threading.Thread(target=_gateway_alive, args=(redis_server, names, beats), daemon=True)
    gateway.start()
    try:
        wait_for(lambda: (s.read_heartbeats(), WORKER in s.workers)[1], 10, what="the worker is heard")
        ev = placed(redis_server, names, s)
        redis_server.proc.send_signal(signal.SIGSTOP)
        _tick_for(s, 2.5)  # Redis answers nothing for 2.5 TTLs
        redis_server.proc.send_signal(signal.SIGCONT)
        _tick_for(s, 3.0)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
        beats.stop()
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"
    assert len(scheduled_on(redis_client, names)) == 1


def _gateway_alive(redis_server, names, beats: Heartbeater) -> None:
    """gw1 refreshes its liveness like a gateway does (failing while Redis is away) until the beats stop."""
    live = Liveness(names, "gateway", "gw1", 0.2, 1.0)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.5)
    while not beats._stop.wait(0.2):
        try:
            live.refresh(client)
        except redis.RedisError:
            continue


def _tick_for(s: SchedulerService, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.tick()
        except redis.RedisError:
            time.sleep(0.05)


def test_request_of_a_dead_gateway_is_cancelled_and_its_reply_stream_told(redis_server, redis_client, names):
    s = scheduler(redis_server, names, liveness_ttl_s=0.2)
    s.on_heartbeat(heartbeat(draining=True))  # no room: the request stays queued
    ev = preprocessed_request(redis_server, names, reply_to=names.reply_stream("gone"))
    deliver(s, names.preprocessed_stream(0), ev)
    wait_for(
        lambda: (s.recover_lost(), state(redis_client, names, ev.request_id) == "CANCELLED")[1],
        10,
        what="the orphan is cancelled",
    )
    told = [decode(f[b"e"]) for _, f in redis_client.xrange(names.reply_stream("gone"))]
    assert [(type(e).__name__, e.request_id) for e in told] == [("Cancelled", ev.request_id)]


def test_a_detached_request_of_a_dead_gateway_runs_on(redis_server, redis_client, names):
    s = scheduler(redis_server, names, liveness_ttl_s=0.2)
    s.on_heartbeat(heartbeat(draining=True))  # no room: the requests stay queued
    gone = names.reply_stream("gone")
    detached = preprocessed_request(redis_server, names, reply_to=gone, meta={"detached": True})
    attached = preprocessed_request(redis_server, names, reply_to=gone)
    for ev in (detached, attached):
        deliver(s, names.preprocessed_stream(0), ev)
    wait_for(
        lambda: (s.recover_lost(), state(redis_client, names, attached.request_id) == "CANCELLED")[1],
        10,
        what="the attached orphan is cancelled",
    )
    assert state(redis_client, names, detached.request_id) == "QUEUED" and len(s.queue) == 1


def test_cancel_reaching_a_replica_with_a_stale_copy_still_stops_the_worker(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    a.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names)
    deliver(a, names.preprocessed_stream(0), ev)
    b.sync()  # b adopts the queued request
    a.place()  # a places it; b's copy is stale until its next sync
    deliver(b, names.control_stream, CancelRequested(request_id=ev.request_id, reason="client_cancel"))
    cancels = [e for e in scheduled_on(redis_client, names) if isinstance(e, CancelRequested)]
    assert [c.request_id for c in cancels] == [ev.request_id]


def test_a_replica_placing_a_request_already_running_elsewhere_carries_on(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    for s in (a, b):
        s.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names)
    deliver(a, names.preprocessed_stream(0), ev)
    b.sync()
    a.place()
    Lifecycle(redis_client, names, "worker", 60).transition(ev.request_id, State.PREFILLING)
    b.place()  # its stale copy: refused, not raised
    assert len(b.queue) == 0
    assert len(scheduled_on(redis_client, names)) == 1
    assert state(redis_client, names, ev.request_id) == "PREFILLING"


def test_a_worker_that_lost_its_request_writes_no_token_for_it(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    first = scheduled_on(redis_client, names)[0]
    s.requeue(first, (), "worker_lost")  # the scheduler gave up on w1 (it hung) and placed it again
    s.on_heartbeat(heartbeat("w2"))
    s.workers.pop(WORKER)
    s.place()
    stale = step_publisher(redis_client, names)
    active = {ev.request_id: Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1)}
    step = StepResult(outputs=[RequestOutput(ev.request_id, [42], 0)], transitions=[(ev.request_id, State.DECODING)])
    lost = stale.publish(1, step, active, lambda rid: None)  # w1 wakes up and publishes its step
    assert lost == {ev.request_id}
    assert redis_client.llen(names.tokens(ev.request_id)) == 0
    assert redis_client.xlen(ev.reply_to) == 0
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"


def test_a_step_published_again_appends_its_tokens_once(redis_server, redis_client, names):
    """A step's publish retried after part of it committed (a Redis Cluster failover in its middle) finds its
    tokens in the list already: they are appended at their index, never twice."""
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    pub = step_publisher(redis_client, names)
    step = StepResult(
        outputs=[RequestOutput(ev.request_id, [42, 43], 0)], transitions=[(ev.request_id, State.PREFILLING)]
    )
    for _ in range(2):  # the same step, as a retry sends it (the worker's record is extended only after success)
        active = {ev.request_id: Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1)}
        assert pub.publish(1, step, active, lambda rid: None) == set()
    assert redis_client.lrange(names.tokens(ev.request_id), 0, -1) == [b"42", b"43"]


@pytest.mark.parametrize("to", [State.TIMED_OUT, State.PREFILLING])
def test_a_stale_attempt_cannot_move_the_request(redis_server, redis_client, names, to):
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    s.requeue(scheduled_on(redis_client, names)[0], (), "worker_lost")
    s.place()
    lc = Lifecycle(redis_client, names, "worker", 60)
    res = lc.transition(
        ev.request_id, to, "", [Publish(ev.reply_to, CancelRequested(request_id="x", reason="t"))], fence=1
    )
    assert res.fenced and not res.applied
    assert state(redis_client, names, ev.request_id) == "SCHEDULED"
    assert redis_client.xlen(ev.reply_to) == 0


def test_after_a_data_loss_a_worker_keeps_the_requests_placed_since(redis_server, redis_client, names):
    """The worker notices the loss after a request of the new dataset reached it: it drops only the old ones."""
    from services.worker.engine import EngineRequest, SamplingOptions
    from services.worker.service import WorkerService
    from shared.settings import WorkerSettings
    from tests.support.cache import CACHE_DIR

    w = WorkerService(
        WorkerSettings(
            redis_url=redis_server.url, namespace=names.ns, engine="sim", cache_dir=CACHE_DIR, instance_id=WORKER
        )
    )
    w.housekeeping()  # adopts the dataset's epoch
    s = scheduler(redis_server, names)
    old = placed(redis_server, names, s)
    redis_client.flushall()  # the loss; then a request of the new dataset is placed on the worker
    s = scheduler(redis_server, names)
    new = placed(redis_server, names, s)
    for ev in (old, new):
        w.engine.add_request(
            EngineRequest(
                request_id=ev.request_id,
                prompt_token_ids=[1, 2, 3],
                sampling=SamplingOptions(temperature=0.0, max_tokens=4),
            )
        )
        w.active[ev.request_id] = Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1)
    w._epoch_checked = 0.0  # its next heartbeat interval has come
    w.housekeeping()
    assert set(w.active) == {new.request_id}


def test_a_request_that_lost_its_worker_max_attempts_times_fails_with_worker_lost(redis_server, redis_client, names):
    """Each loss requeues it at the next attempt; the last allowed placement lost too, it fails (a request that
    kills every worker it lands on must not go round the cluster for ever)."""
    from tests.support.scheduling import WORKER, heartbeat, placed, scheduled_on, scheduler, state

    s = scheduler(redis_server, names, max_attempts=2)
    ev = placed(redis_server, names, s)
    (first,) = scheduled_on(redis_client, names)
    assert s.requeue(first, (), "worker_lost") and state(redis_client, names, ev.request_id) == "QUEUED"
    s.on_heartbeat(heartbeat(WORKER))
    s.place()
    second = [e for e in scheduled_on(redis_client, names) if e.attempt == 2]
    assert second, "placed again at attempt 2"
    s.requeue(second[0], (), "worker_lost")
    assert state(redis_client, names, ev.request_id) == "FAILED"
    assert redis_client.hget(names.layer(ev.request_id, "meta"), "reason") == b"worker_lost"
