"""Placement finished from what Redis holds (issue 24, item 7; services/scheduler/repair.py): a scheduler killed
between its placement steps, or a placement script re-sent after its reply was lost, left a request SCHEDULED
with no assignment (and, on a Redis Cluster, no event on its worker's inbox) until its cap. Real Redis, and a real
3-master Redis Cluster; the scheduler's death is the process stopping at that point of its code."""

from __future__ import annotations

import uuid
from contextlib import contextmanager

import pytest

from services.scheduler.service import SchedulerService
from shared.wire.events import HandBack
from shared.state.lifecycle import Lifecycle, State
from shared.settings import SchedulerSettings
from tests.support.scheduling import WORKER, deliver, heartbeat, preprocessed_request, scheduled_on, scheduler
from tests.redis.test_redis_cluster_recovery import _preprocessed
from tests.support.waiting import wait_for

GRACE_S = "0.2"  # CONVEYOR_PLACEMENT_GRACE_S: a placement round trip here is a few ms


class Killed(BaseException):
    """The scheduler process dying at this point: nothing after it runs."""


def place_cut_short(s: SchedulerService, monkeypatch) -> None:
    """Place what s holds, the process dying right after the SCHEDULED transitions' pipeline: before the events
    that go after it (a cluster's inboxes) and before the records."""

    def die(*_a, **_kw):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(s.lifecycle, "complete", die)
        with pytest.raises(Killed):
            s.place()


def resend_placements(s: SchedulerService, monkeypatch) -> None:
    """Each transition script s sends is sent twice and the first reply is lost: what a client's retry after a
    timeout or a dropped connection does (redis-py's, or the cluster client's)."""
    real = s.lifecycle._script

    def twice(keys, args, client=None):
        if client is None:
            real(keys=keys, args=args)
            return real(keys=keys, args=args)
        real(keys=keys, args=args, client=client)
        real(keys=keys, args=args, client=client)
        if not getattr(client, "resent", False):  # the pipeline answers with the second run's replies
            execute = client.execute
            client.execute = lambda raise_on_error=True: execute(raise_on_error=raise_on_error)[1::2]
            client.resent = True

    monkeypatch.setattr(s.lifecycle, "_script", twice)


@contextmanager
def janitor_running(s: SchedulerService):
    s.janitor_loop.start()
    try:
        yield
    finally:
        s.janitor_loop.stop()


def knows(s: SchedulerService, rid: str) -> bool:
    s.sync()
    return rid in s.assignments.by_request


def cluster_scheduler(redis_cluster, ns: str, **kw) -> SchedulerService:
    s = SchedulerService(SchedulerSettings(redis_url=redis_cluster.url, redis_cluster=True, namespace=ns, **kw))
    s.ensure_groups()
    return s


def queued_on_cluster(s: SchedulerService, redis_cluster) -> str:
    ev = _preprocessed(s.s, s)
    deliver(s, s.names.preprocessed_stream(s.names.partition(ev.request_id)), ev)
    return ev.request_id


def _placed_cut_short(redis_server, names, monkeypatch):
    """One request placed on one Redis by a scheduler that stopped right after its first placement pipeline."""
    monkeypatch.setenv("CONVEYOR_PLACEMENT_GRACE_S", GRACE_S)
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names)
    deliver(s, names.preprocessed_stream(0), ev)
    place_cut_short(s, monkeypatch)
    return ev


def test_a_placement_cut_short_before_its_record_is_recorded_from_its_event_on_the_inbox(
    redis_server, redis_client, names, monkeypatch
):
    ev = _placed_cut_short(redis_server, names, monkeypatch)
    [(entry_id, _)] = redis_client.xrange(names.worker_stream(WORKER))  # one Redis: it went with the transition
    restarted = scheduler(redis_server, names, janitor_interval_s=0.05)
    with janitor_running(restarted):
        wait_for(lambda: knows(restarted, ev.request_id), 10, what="the placement recorded")
    a = restarted.assignments.by_request[ev.request_id]
    assert (a.worker_id, a.entry_id.encode(), a.scheduled.attempt) == (WORKER, entry_id, 1)
    assert restarted.records.get(ev.request_id) is None
    assert len(redis_client.xrange(names.worker_stream(WORKER))) == 1  # not sent again


def test_a_placement_cut_short_whose_worker_started_it_is_recorded_from_the_workers_heartbeat(
    redis_server, redis_client, names, monkeypatch
):
    ev = _placed_cut_short(redis_server, names, monkeypatch)
    [(entry_id, _)] = redis_client.xrange(names.worker_stream(WORKER))
    # The worker read it, trimmed its inbox and started it: only its heartbeat says where it runs.
    redis_client.xtrim(names.worker_stream(WORKER), maxlen=0)
    Lifecycle(redis_client, names, "worker", 60).transition(ev.request_id, State.PREFILLING, fence=1)
    restarted = scheduler(redis_server, names)
    beat = heartbeat(request_ids=(ev.request_id,), last_read_id=entry_id.decode(), num_running=1)
    wait_for(
        lambda: (restarted.on_heartbeat(beat), knows(restarted, ev.request_id))[1], 10, what="the placement recorded"
    )
    a = restarted.assignments.by_request[ev.request_id]
    assert (a.worker_id, a.scheduled.attempt, a.scheduled.prompt_token_ids) == (WORKER, 1, ev.prompt_token_ids)
    assert restarted.records.get(ev.request_id) is None


def test_a_placement_script_resent_after_its_reply_was_lost_is_applied_once(
    redis_server, redis_client, names, monkeypatch
):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names)
    deliver(s, names.preprocessed_stream(0), ev)
    resend_placements(s, monkeypatch)
    s.place()
    [(entry_id, _)] = redis_client.xrange(names.worker_stream(WORKER))
    other = scheduler(redis_server, names)
    assert knows(other, ev.request_id)  # recorded in Redis, not only in s's memory
    assert other.assignments.by_request[ev.request_id].entry_id.encode() == entry_id
    assert s.records.get(ev.request_id) is None


def test_on_a_cluster_a_placement_script_resent_after_its_reply_was_lost_sends_its_event_once(
    redis_cluster, monkeypatch
):
    s = cluster_scheduler(redis_cluster, f"t{uuid.uuid4().hex[:8]}")
    s.on_heartbeat(heartbeat())
    rid = queued_on_cluster(s, redis_cluster)
    resend_placements(s, monkeypatch)
    s.place()
    assert [e.request_id for e in scheduled_on(s.r, s.names)] == [rid]
    assert knows(cluster_scheduler(redis_cluster, s.names.ns), rid)


def test_on_a_cluster_a_placement_cut_short_before_its_event_was_sent_is_placed_again(redis_cluster, monkeypatch):
    monkeypatch.setenv("CONVEYOR_PLACEMENT_GRACE_S", GRACE_S)
    ns = f"t{uuid.uuid4().hex[:8]}"
    s = cluster_scheduler(redis_cluster, ns)
    s.on_heartbeat(heartbeat())
    rid = queued_on_cluster(s, redis_cluster)
    place_cut_short(s, monkeypatch)
    assert scheduled_on(s.r, s.names) == []  # its event was still to be sent
    restarted = cluster_scheduler(redis_cluster, ns, janitor_interval_s=0.05)

    def placed_again():
        restarted.on_heartbeat(heartbeat())
        restarted.sync()
        restarted.place()
        return [e.attempt for e in scheduled_on(s.r, s.names)]

    with janitor_running(restarted):
        assert wait_for(placed_again, 15, what="the request placed again") == [2]
        assert knows(restarted, rid) and restarted.assignments.by_request[rid].scheduled.attempt == 2
    assert s.r.hget(s.names.layer(rid, "exec"), "attempt") == b"2"
    assert [e.attempt for e in scheduled_on(s.r, s.names)] == [2]  # the sweeps that came after changed nothing


def test_a_placement_from_a_stale_queue_record_does_not_set_the_attempt_back(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    ev = preprocessed_request(redis_server, names)
    deliver(a, names.preprocessed_stream(0), ev)
    b.sync()  # b holds it at attempt 1, and is not told what follows
    a.on_heartbeat(heartbeat())
    for _ in range(2):  # placed, its worker lost, placed again at attempt 2, lost again: QUEUED at attempt 3
        a.place()
        a.requeue(scheduled_on(redis_client, names)[-1], (), "worker_lost")
    b.on_heartbeat(heartbeat())
    b.place()
    assert redis_client.hget(names.layer(ev.request_id, "exec"), "attempt") == b"2"
    assert len(scheduled_on(redis_client, names)) == 2


def test_a_placement_refused_as_stale_is_placed_at_the_attempt_redis_holds(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    ev = preprocessed_request(redis_server, names)
    deliver(a, names.preprocessed_stream(0), ev)
    b.sync()
    a.on_heartbeat(heartbeat())
    for _ in range(2):
        a.place()
        a.requeue(scheduled_on(redis_client, names)[-1], (), "worker_lost")
    b.on_heartbeat(heartbeat())
    b.place()  # refused: Redis holds attempt 2 placed, 3 queued
    b.place()
    assert [e.attempt for e in scheduled_on(redis_client, names)] == [1, 2, 3]
    assert redis_client.hget(names.layer(ev.request_id, "exec"), "attempt") == b"3"


def test_a_heartbeat_read_by_a_replica_with_a_stale_placement_does_not_erase_the_newer_one(
    redis_server, redis_client, names
):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    ev = preprocessed_request(redis_server, names)
    deliver(a, names.preprocessed_stream(0), ev)
    a.on_heartbeat(heartbeat())
    a.place()
    b.sync()  # b knows it on w1, and is not told what follows
    [first] = scheduled_on(redis_client, names)
    deliver(
        a,
        names.control_stream,
        HandBack(request_id=ev.request_id, worker_id=WORKER, reason="shutdown", scheduled=first, output_token_ids=()),
    )  # requeued, its placement dropped
    a.on_heartbeat(heartbeat(draining=True))  # w1 takes no more work
    a.on_heartbeat(heartbeat("w2"))
    a.place()
    [(read, _)] = redis_client.xrange(names.worker_stream(WORKER))
    b.on_heartbeat(heartbeat(last_read_id=read.decode()))  # w1 read it and holds nothing: over, for b
    c = scheduler(redis_server, names)
    assert knows(c, ev.request_id) and c.assignments.by_request[ev.request_id].worker_id == "w2"
