"""The scheduler's queue and worker views at the scale of a burst (issue 12): the work ahead of an arrival and a
worker's blocks in flight are kept as running sums, not recomputed over the whole queue or every placement."""

from __future__ import annotations

import time

from services.scheduler.state import QueuedRequest, RequestQueue, WorkerView
from shared.wire.events import Preprocessed, Sampling
from tests.support.scheduling import heartbeat

BURST = 400


def request(i: int, received_at: float, prompt_len: int = 10, max_tokens: int = 32) -> Preprocessed:
    return Preprocessed(
        request_id=f"r{i}",
        reply_to="reply",
        prompt_token_ids=tuple(range(prompt_len)),
        sampling=Sampling(max_tokens=max_tokens),
        priority=0,
        deadline=received_at + 60,
        adaptive_deadline=True,
        received_at=received_at,
    )


def test_the_work_ahead_of_each_arrival_of_a_burst_is_found_without_a_pass_over_the_queue(monkeypatch):
    calls = {"n": 0}
    work = QueuedRequest.work
    monkeypatch.setattr(QueuedRequest, "work", lambda self: calls.__setitem__("n", calls["n"] + 1) or work(self))
    q, t0, aheads = RequestQueue(), time.time(), []
    for i in range(BURST):
        aheads.append(q.work_ahead_of(q.push(request(i, t0 + i))))
    assert [a.prefill_tokens for a in aheads] == [10 * i for i in range(BURST)]
    assert [a.decode_tokens for a in aheads] == [32 * i for i in range(BURST)]
    assert calls["n"] <= 3 * BURST  # a pass over the queue per arrival made it BURST^2 / 2


def test_an_arrival_older_than_the_queue_counts_only_what_is_ahead_of_it():
    q, t0 = RequestQueue(), time.time()
    for i in range(3):
        q.push(request(i, t0 + 10 + i))
    q.remove("r1")
    resumed = q.push(request(9, t0 + 10.5, prompt_len=20))  # moved back with its original arrival time
    later = q.push(request(10, t0 + 20))
    assert (q.work_ahead_of(resumed).prefill_tokens, q.work_ahead_of(resumed).decode_tokens) == (10, 32)
    assert (q.work_ahead_of(later).prefill_tokens, q.work_ahead_of(later).decode_tokens) == (40, 96)


def test_a_workers_free_blocks_count_what_is_in_flight_to_it_until_it_reads_it():
    w = WorkerView("w1", heartbeat(free_blocks=100), time.monotonic())
    w.add_inflight("a", "5-0", 3)
    w.add_inflight("b", "7-0", 4)
    w.drop_inflight("a")
    w.add_inflight("c", "9-0", 2)
    assert w.free_blocks() == 94
    w.observe(heartbeat(free_blocks=90, last_read_id="7-0"))  # it has read b: b is in its own figures now
    assert w.free_blocks() == 88 and list(w.inflight) == ["c"]
