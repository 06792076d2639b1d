"""Adaptive deadlines: an allowance fixed in work, priced with the latest measured costs (a pure policy), and
extended for a queued request while the queue ahead of it moves (the scheduler on a real Redis)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import redis

from services.scheduler import refusal
from services.scheduler.deadlines import Costs, DeadlinePolicy, Work
from tests.support.scheduling import deliver, heartbeat, preprocessed_request, scheduler, state

POLICY = DeadlinePolicy(factor=1.5, min_s=5.0, max_s=300.0)
AHEAD, OWN = Work(prefill_tokens=3200, decode_tokens=1600), Work(prefill_tokens=32, decode_tokens=16)


def costs(step_s: float, prefill_s: float = 0.001, seqs: int = 64) -> Costs:
    return Costs.of(
        [
            SimpleNamespace(
                prefill_s_per_token=prefill_s,
                step_time_s=step_s,
                decode_s_per_token=step_s,
                max_num_seqs=seqs,
                num_running=seqs,  # every slot taken
                num_waiting=0,
                draining=False,
            )
        ]
    )


def test_a_machine_three_times_slower_stretches_the_allowance_three_times():
    quiet, busy = costs(0.05, 0.001), costs(0.15, 0.003)
    d_quiet = POLICY.deadline(0.0, 1e9, quiet.seconds(AHEAD, OWN))
    d_busy = POLICY.deadline(0.0, 1e9, busy.seconds(AHEAD, OWN))
    assert abs(d_busy - 3 * d_quiet) < 1e-6


def test_prefill_ahead_is_serial_and_decode_ahead_is_shared_by_the_batch():
    c = costs(0.1, 0.001, seqs=64)
    assert abs(c.seconds(AHEAD, OWN) - ((3200 + 32) * 0.001 + (1600 / 64 + 16) * 0.1)) < 1e-9


def test_the_allowance_is_clamped_to_the_floor_and_the_cap():
    c = costs(0.001)
    assert POLICY.deadline(100.0, 1e9, c.seconds(Work(0, 0), Work(1, 1))) == 105.0
    assert POLICY.deadline(100.0, 150.0, 1e6) == 150.0


def test_no_measured_worker_gives_no_prediction():
    assert Costs.of([]) is None


def _queued_behind(redis_server, names, redis_client):
    """Two adaptive requests queued on a cluster whose only worker has no free slot."""
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat(draining=True))
    first, second = (preprocessed_request(redis_server, names, adaptive=True) for _ in range(2))
    for ev in (first, second):
        deliver(s, names.preprocessed_stream(0), ev)
    return s, s.queue._live[first.request_id], s.queue._live[second.request_id]


def test_a_queued_request_past_its_allowance_is_extended_while_the_queue_ahead_moves(redis_server, redis_client, names):
    s, _first, second = _queued_behind(redis_server, names, redis_client)
    second.ahead = Work(second.ahead.prefill_tokens + 5000, second.ahead.decode_tokens)  # more was ahead before
    second.deadline = time.time() - 1
    s.expire_deadlines()
    assert second.request_id in s.queue and second.deadline > time.time()
    assert state(redis_client, names, second.request_id) == "QUEUED"


def test_a_queued_request_past_its_allowance_is_extended_while_live_workers_step(redis_server, redis_client, names):
    s, first, second = _queued_behind(redis_server, names, redis_client)
    for q in (first, second):  # neither the queue moved nor anyone was placed: the worker is busy, not stuck
        q.deadline = time.time() - 1
    s.expire_deadlines()
    assert all(q.request_id in s.queue and q.deadline > time.time() for q in (first, second))


def test_a_queued_request_past_its_allowance_with_no_live_worker_times_out(redis_server, redis_client, names):
    s, _first, second = _queued_behind(redis_server, names, redis_client)
    s.workers.clear()  # its only worker is gone: nothing will ever serve the queue
    second.deadline = time.time() - 1
    s.expire_deadlines()
    assert second.request_id not in s.queue
    assert state(redis_client, names, second.request_id) == "TIMED_OUT"


def _behind_a_long_queue(redis_server, names, adaptive: bool):
    """A cluster whose only worker (1 slot, 1 s a step) is busy, a request queued that needs 2,000 steps, then one
    whose timeout is 60 s: it cannot even start in time."""
    from shared.wire.events import decode

    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat(max_num_seqs=1, num_running=1, step_time_s=1.0, decode_s_per_token=1.0))
    long = preprocessed_request(redis_server, names, adaptive=True, max_tokens=2000, timeout_s=3000)
    deliver(s, names.preprocessed_stream(0), long)
    late = preprocessed_request(redis_server, names, adaptive=adaptive, timeout_s=60)
    deliver(s, names.preprocessed_stream(0), late)
    replies = [decode(f[b"e"]) for _, f in redis.Redis.from_url(redis_server.url).xrange(late.reply_to)]
    return s, late, [r for r in replies if getattr(r, "request_id", "") == late.request_id]


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_request_that_cannot_start_within_its_timeout_is_refused_at_once(redis_server, redis_client, names, adaptive):
    s, late, replies = _behind_a_long_queue(redis_server, names, adaptive)
    assert state(redis_client, names, late.request_id) == "FAILED" and late.request_id not in s.queue
    (failed,) = replies
    assert failed.reason == "overloaded" and failed.retry_after_s >= 1900  # ~2,000 s of work ahead, less its 60


def test_a_request_that_can_start_in_time_is_queued(redis_server, redis_client, names):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat(max_num_seqs=1, num_running=1, step_time_s=0.01, decode_s_per_token=0.01))
    ev = preprocessed_request(redis_server, names, max_tokens=20, timeout_s=60)
    deliver(s, names.preprocessed_stream(0), ev)
    assert state(redis_client, names, ev.request_id) == "QUEUED"


def test_the_wait_to_start_is_priced_in_whole_steps_without_adding_prefill_again():
    """A heartbeat's step time is the average of whole steps, chunked prefill included: pricing the prompts ahead
    on top of it counted their prefill twice (the overload benchmark saw waits predicted 2-4x too long, and
    requests refused that were served in time)."""
    c = costs(0.1, prefill_s=0.01, seqs=4)
    assert (
        abs(c.wait_to_start(Work(prefill_tokens=10_000, decode_tokens=400), requests_ahead=10) - 400 / 4 * 0.1) < 1e-9
    )


def test_a_queued_request_is_refused_once_slower_steps_mean_it_cannot_start_in_time(redis_server, redis_client, names):
    """Judged on arrival with fast steps it could start in time; then the machine got busy (the overload benchmark's
    CPU hogs): judged again each second with the latest costs, it is refused then (429 with Retry-After), not held
    until its timeout gives a 504."""
    from shared.wire.events import decode

    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat(max_num_seqs=1, num_running=1, step_time_s=0.01, decode_s_per_token=0.01))
    long = preprocessed_request(redis_server, names, max_tokens=2000, timeout_s=3000)
    late = preprocessed_request(redis_server, names, timeout_s=60)
    for ev in (long, late):
        deliver(s, names.preprocessed_stream(0), ev)
    assert state(redis_client, names, late.request_id) == "QUEUED"  # 2,000 steps of 10 ms: 20 s, within its 60
    s.on_heartbeat(heartbeat(max_num_seqs=1, num_running=1, step_time_s=1.0, decode_s_per_token=1.0))
    refusal.refuse_those_too_late(s)
    assert state(redis_client, names, late.request_id) == "FAILED" and late.request_id not in s.queue
    assert state(redis_client, names, long.request_id) == "QUEUED"  # nothing ahead of it: it can start in time
    (failed,) = [
        r for _, f in redis_client.xrange(late.reply_to) if (r := decode(f[b"e"])).request_id == late.request_id
    ]
    assert failed.reason == "overloaded" and failed.retry_after_s >= 1900


def test_a_request_is_not_refused_while_a_worker_has_a_free_slot_for_it(redis_server, redis_client, names):
    """One long request runs on a worker with 8 slots: the next one starts at once in a free slot, whatever the
    long one has left to decode. Pricing its wait as the long one's drain (2,000 steps / 8 slots x 1 s) refused it."""
    s = scheduler(redis_server, names)
    s.on_heartbeat(
        heartbeat(max_num_seqs=8, num_running=1, step_time_s=1.0, decode_s_per_token=1.0, decode_tokens_left=2000)
    )
    ev = preprocessed_request(redis_server, names, timeout_s=5)
    deliver(s, names.preprocessed_stream(0), ev)
    refusal.refuse_those_too_late(s)
    assert state(redis_client, names, ev.request_id) == "QUEUED" and ev.request_id in s.queue
