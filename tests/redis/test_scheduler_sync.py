"""Scheduler replicas share the queue and the placements through Redis (docs/reliability.md, "Shared scheduler
state"): a replica's periodic sync reads only what changed since its last (issue 24, item 2: it read every
queued record, prompts included, every second), and still learns everything another replica did."""

from __future__ import annotations

from tests.support.scheduling import WORKER, deliver, heartbeat, preprocessed_request, scheduled_on, scheduler

LONG_PROMPT = tuple(range(1000, 5000))  # ~12 KB a queued record: reading one shows in the bytes Redis sends


def queue_on(s, redis_server, names, n: int, prompt: tuple[int, ...] = (1, 2, 3)) -> list:
    events = [preprocessed_request(redis_server, names, prompt_token_ids=prompt) for _ in range(n)]
    for ev in events:
        deliver(s, names.preprocessed_stream(0), ev)
    return events


def sent_bytes(client) -> int:
    return client.info("stats")["total_net_output_bytes"]


def test_a_replicas_sync_reads_the_records_queued_since_its_last_not_those_it_knows(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    queue_on(a, redis_server, names, 20, LONG_PROMPT)
    b.sync()
    [new] = queue_on(a, redis_server, names, 1, LONG_PROMPT)
    record = len(redis_client.hget(names.queue(0), new.request_id))
    before = sent_bytes(redis_client)
    b.sync()
    read = sent_bytes(redis_client) - before
    assert len(b.queue) == 21 and new.request_id in b.queue
    assert read < 2 * record, f"{read} bytes read by a sync with one {record}-byte record to learn"


def test_a_replica_drops_a_request_another_placed(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    queue_on(a, redis_server, names, 1)
    b.sync()
    a.on_heartbeat(heartbeat())
    a.place()
    b.sync()
    assert len(b.queue) == 0


def test_a_replica_learns_the_placements_another_made(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    b.sync()
    [ev] = queue_on(a, redis_server, names, 1)
    a.on_heartbeat(heartbeat())
    a.place()
    b.sync()
    assert b.assignments.by_request[ev.request_id].worker_id == WORKER
    assert WORKER in b.workers  # known from the placement until its heartbeat is heard


def test_a_replica_takes_a_request_requeued_by_another_at_its_new_attempt(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    queue_on(a, redis_server, names, 1)
    b.sync()
    a.on_heartbeat(heartbeat())
    a.place()
    a.requeue(scheduled_on(redis_client, names)[0], (7,), "worker_lost")  # between two of b's syncs
    b.sync()
    [item] = b.queue.items()
    assert (item.attempt, item.output_token_ids) == (2, (7,))  # placed from its stale copy, it would start over


def test_a_replica_whose_unread_changes_were_trimmed_reads_everything_again(redis_server, redis_client, names):
    a, b = scheduler(redis_server, names), scheduler(redis_server, names)
    b.sync()
    [ev] = queue_on(a, redis_server, names, 1)
    redis_client.xtrim(names.queue_changes(0), maxlen=0)  # b was away longer than the changes are kept
    b.sync()
    assert ev.request_id in b.queue


def test_a_request_whose_placement_failed_is_queued_again_at_the_next_sync(
    redis_server, redis_client, names, monkeypatch
):
    s = scheduler(redis_server, names)
    [ev] = queue_on(s, redis_server, names, 1)
    s.sync()
    s.on_heartbeat(heartbeat())
    monkeypatch.setattr(s.lifecycle, "queue", lambda pipe, *a, **kw: (pipe.execute_command("NO-SUCH-CMD"), ())[1])
    s.place()  # Redis refuses the placement: the request left this replica's queue, its record stayed
    monkeypatch.undo()
    assert ev.request_id not in s.queue
    s.sync()
    s.place()
    assert [e.request_id for e in scheduled_on(redis_client, names)] == [ev.request_id]
