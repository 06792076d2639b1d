"""The scheduler's repair of what a Redis Cluster can lose between a placement and its event (in process, on a
real 3-master cluster: tests/support/redis_cluster.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

from services.scheduler.service import SchedulerService
from services.worker.engine.outputs import RequestOutput, StepResult
from services.worker.publisher import Active
from shared.wire.bus import entry_key
from shared.state.context_store import ContextStore
from shared.wire.constants import EVENT_FIELD
from shared.wire.events import Completed, Preprocessed, Sampling, TokenGenerated, decode
from shared.state.lifecycle import Lifecycle, State
from shared.redis_io.redis_client import async_client
from shared.settings import SchedulerSettings
from tests.support.scheduling import WORKER, deliver, heartbeat, step_publisher


def _preprocessed(settings: SchedulerSettings, s: SchedulerService) -> Preprocessed:
    """A request created by the gateway's script and moved to PREPROCESSED as the tokenizer does."""
    now = time.time()
    ev = Preprocessed(
        request_id=f"r{uuid.uuid4().hex[:8]}",
        reply_to=s.names.reply_stream("gw1"),
        prompt_token_ids=(1, 2, 3),
        sampling=Sampling(max_tokens=4, temperature=0.0),
        priority=0,
        deadline=now + 60,
        received_at=now,
    )

    async def create():
        client = async_client(settings)
        await ContextStore(client, s.names, 60).acreate(ev.request_id, {"reply_to": ev.reply_to}, {}, ev)
        await client.aclose()

    asyncio.run(create())
    Lifecycle(s.r, s.names, "tokenizer", 60).transition(ev.request_id, State.PREPROCESSED)
    return ev


def test_a_placement_whose_event_never_reached_its_worker_is_queued_again(redis_cluster):
    settings = SchedulerSettings(redis_url=redis_cluster.url, redis_cluster=True, namespace=f"t{uuid.uuid4().hex[:8]}")
    s = SchedulerService(settings)
    s.ensure_groups()
    s.on_heartbeat(heartbeat())
    ev = _preprocessed(settings, s)
    deliver(s, s.names.preprocessed_stream(s.names.partition(ev.request_id)), ev)
    s.place()
    placed = s.assignments.by_request[ev.request_id]
    meta = s.names.layer(ev.request_id, "meta")
    assert s.r.hget(meta, "state") == b"SCHEDULED"
    s.r.delete(s.names.worker_stream(WORKER))  # the inbox write lost in a failover: the worker never sees it
    ms, seq = entry_key(placed.entry_id)
    s.on_heartbeat(heartbeat(last_read_id=f"{ms}-{seq + 1}"))  # the worker read past it, holds nothing
    assert s.r.hget(meta, "state") == b"QUEUED"
    assert ev.request_id in s.queue
    assert s.r.hget(s.names.layer(ev.request_id, "meta"), "reason") == b"lost_in_transit"


def test_a_workers_step_on_a_cluster_writes_nothing_for_a_request_placed_elsewhere(redis_cluster):
    """The step's writes for all partitions go in one pipeline, each refused on its own for a request whose
    exec.attempt moved on (this worker hung; the scheduler placed it again): its tokens, its output layer, its
    transition and its reply events are not written; the other request's are."""
    settings = SchedulerSettings(redis_url=redis_cluster.url, redis_cluster=True, namespace=f"t{uuid.uuid4().hex[:8]}")
    s = SchedulerService(settings)
    s.ensure_groups()
    s.on_heartbeat(heartbeat())
    evs = [_preprocessed(settings, s), _preprocessed(settings, s)]
    while s.names.partition(evs[1].request_id) == s.names.partition(evs[0].request_id):  # two hash slots
        evs[1] = _preprocessed(settings, s)
    for ev in evs:
        deliver(s, s.names.preprocessed_stream(s.names.partition(ev.request_id)), ev)
    s.place()
    stale, kept = evs
    s.r.hset(s.names.layer(stale.request_id, "exec"), "attempt", 2)  # placed again while this worker hung
    pub = step_publisher(s.r, s.names)
    active = {ev.request_id: Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1) for ev in evs}
    step = StepResult(
        outputs=[RequestOutput(ev.request_id, [42], 0, finished=True, finish_reason="length") for ev in evs],
        transitions=[(ev.request_id, to) for ev in evs for to in (State.PREFILLING, State.DECODING)],
    )
    assert pub.publish(1, step, active, lambda rid: ([1], 0)) == {stale.request_id}
    layer = lambda ev, name: s.r.hgetall(s.names.layer(ev.request_id, name))  # noqa: E731
    assert s.r.lrange(s.names.tokens(stale.request_id), 0, -1) == []
    assert layer(stale, "output") == {} and layer(stale, "meta")[b"state"] == b"SCHEDULED"
    assert s.r.lrange(s.names.tokens(kept.request_id), 0, -1) == [b"42"]
    assert layer(kept, "output")[b"output_tokens"] == b"1" and layer(kept, "meta")[b"state"] == b"FINISHED"
    replies = [decode(e[EVENT_FIELD]) for _id, e in s.r.xrange(kept.reply_to)]  # both requests' stream
    assert [type(e) for e in replies] == [TokenGenerated, Completed]
    assert [d.request_id for d in replies[0].items] == [kept.request_id] and replies[1].request_id == kept.request_id
