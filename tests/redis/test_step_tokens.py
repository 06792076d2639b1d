"""A worker's step that only adds tokens (no state moves, nothing ends) is one script on a single Redis
(services/worker/publisher.py, _TOKENS_LUA): fenced per request, appended once however often it is sent, its reply
event carrying exactly the requests written. Real Redis, the scheduler's own placement, no model."""

from __future__ import annotations

import time

from services.worker.engine.outputs import RequestOutput, StepResult
from services.worker.publisher import Active
from shared.wire.events import decode
from tests.support.scheduling import WORKER, heartbeat, placed, scheduled_on, scheduler, step_publisher


def two_placed(redis_server, redis_client, names):
    """Two requests placed on WORKER; the second then given up on and placed on w2 (attempt 2)."""
    s = scheduler(redis_server, names)
    kept, moved = placed(redis_server, names, s), placed(redis_server, names, s)
    s.requeue(scheduled_on(redis_client, names)[1], (), "worker_lost")
    s.on_heartbeat(heartbeat("w2"))
    s.workers.pop(WORKER)
    s.place()
    return kept, moved


def held(*evs) -> dict[str, Active]:
    return {ev.request_id: Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1) for ev in evs}


def test_a_tokens_only_step_leaves_out_a_request_placed_elsewhere_and_writes_the_rest(
    redis_server, redis_client, names
):
    kept, moved = two_placed(redis_server, redis_client, names)
    step = StepResult(outputs=[RequestOutput(kept.request_id, [42], 0), RequestOutput(moved.request_id, [7], 0)])
    active = held(kept, moved)
    lost = step_publisher(redis_client, names).publish(1, step, active, lambda rid: None)
    assert lost == {moved.request_id}
    assert redis_client.lrange(names.tokens(kept.request_id), 0, -1) == [b"42"]
    assert redis_client.llen(names.tokens(moved.request_id)) == 0
    ((_, fields),) = redis_client.xrange(kept.reply_to)
    items = decode(fields[b"e"]).items
    assert [(i.request_id, i.token_ids) for i in items] == [(kept.request_id, (42,))]
    assert active[kept.request_id].output_token_ids == [42]


def test_a_tokens_only_step_sent_twice_appends_its_tokens_once(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    pub = step_publisher(redis_client, names)
    step = StepResult(outputs=[RequestOutput(ev.request_id, [42, 43], 0)])
    for _ in range(2):  # the same step again, as a retry sends it (the record is extended only after success)
        assert pub.publish(1, step, held(ev), lambda rid: None) == set()
    assert redis_client.lrange(names.tokens(ev.request_id), 0, -1) == [b"42", b"43"]


def test_a_tokens_only_step_after_a_short_list_sends_what_the_list_lost(redis_server, redis_client, names):
    """The list lost its tail (a failover): the step writes nothing there, says so, and the next step sends the
    missing tokens before its own."""
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    pub = step_publisher(redis_client, names)
    active = held(ev)
    pub.publish(1, StepResult(outputs=[RequestOutput(ev.request_id, [1, 2], 0)]), active, lambda rid: None)
    redis_client.rpop(names.tokens(ev.request_id))  # the failover's loss: [1]
    pub.publish(2, StepResult(outputs=[RequestOutput(ev.request_id, [3], 2)]), active, lambda rid: None)
    assert redis_client.lrange(names.tokens(ev.request_id), 0, -1) == [b"1"]
    pub.publish(3, StepResult(outputs=[RequestOutput(ev.request_id, [4], 3)]), active, lambda rid: None)
    assert redis_client.lrange(names.tokens(ev.request_id), 0, -1) == [b"1", b"2", b"3", b"4"]
