"""The scheduler's repair of what a Redis Cluster can lose between a placement and its event (in process, on a
real 3-master cluster: tests/redis_cluster.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

from services.scheduler.service import SchedulerService
from shared.bus import entry_key
from shared.context_store import ContextStore
from shared.events import Preprocessed, Sampling
from shared.lifecycle import Lifecycle, State
from shared.redis_client import async_client
from shared.settings import SchedulerSettings
from tests.scheduling import WORKER, deliver, heartbeat


def _preprocessed(settings: SchedulerSettings, s: SchedulerService) -> Preprocessed:
    """A request created by the gateway's script and moved to PREPROCESSED as the tokenizer does."""
    now = time.time()
    ev = Preprocessed(request_id=f"r{uuid.uuid4().hex[:8]}", reply_to=s.names.reply_stream("gw1"),
                      prompt_token_ids=(1, 2, 3), sampling=Sampling(max_tokens=4, temperature=0.0), priority=0,
                      deadline=now + 60, received_at=now)

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
