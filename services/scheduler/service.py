"""Scheduler service: queues preprocessed requests and places them on live workers with room.

Durability: a request's QUEUED transition and its copy in the `queue` hash are written
before the preprocessed event is acknowledged, so a restarted scheduler rebuilds its queue
from Redis. Placement is one atomic script: SCHEDULED transition + `scheduled` event on the
worker's stream; a request cancelled meanwhile is refused there and never reaches a worker.
"""

from __future__ import annotations

import logging
import time

import msgspec

from services.scheduler.state import RequestQueue, WorkerView, blocks_needed
from shared.bus import Bus, Delivery
from shared.constants import GROUP_SCHEDULER, Names
from shared.context_store import ContextStore
from shared.errors import InvalidTransition
from shared.events import CancelRequested, Heartbeat, Preprocessed, Scheduled, TimedOut, decode, encode
from shared.lifecycle import Lifecycle, Publish, State
from shared.redis_client import sync_client
from shared.runtime import Liveness, StopFlag, instance_id
from shared.settings import SchedulerSettings

logger = logging.getLogger(__name__)


class SchedulerService:
    def __init__(self, settings: SchedulerSettings):
        self.s = settings
        self.names = Names(settings.namespace)
        self.r = sync_client(settings)
        self.id = instance_id(settings, "scheduler")
        self.bus = Bus(self.r, self.names, self.id, settings.read_block_ms, settings.claim_idle_ms,
                       settings.max_deliveries)
        self.lifecycle = Lifecycle(self.r, self.names, "scheduler", settings.context_ttl_s)
        self.store = ContextStore(self.r, self.names, settings.context_ttl_s)
        self.queue = RequestQueue()
        self.workers: dict[str, WorkerView] = {}
        self.live = Liveness(self.names, "scheduler", self.id, settings.heartbeat_interval_s,
                             settings.liveness_ttl_s)
        self.streams = [self.names.preprocessed_stream, self.names.control_stream, self.names.heartbeat_stream]

    def run(self) -> None:
        stop = StopFlag()
        for stream in self.streams:
            self.bus.ensure_group(stream, GROUP_SCHEDULER)
        self.rebuild_queue()
        logger.info("scheduler %s started, %d queued", self.id, len(self.queue))
        while not stop.stopped:
            deliveries = self.bus.read(self.streams, GROUP_SCHEDULER)
            if self.live.due():
                deliveries += [d for s in self.streams for d in self.bus.sweep(s, GROUP_SCHEDULER)]
                self.live.refresh(self.r, {"queued": len(self.queue)})
            for d in deliveries:
                self.dispatch(d)
            self.expire_deadlines()
            self.place()
        self.live.clear(self.r)

    def dispatch(self, d: Delivery) -> None:
        ev = d.event
        if isinstance(ev, Preprocessed):
            self.on_preprocessed(ev)
        elif isinstance(ev, CancelRequested):
            self.on_cancel(ev)
        elif isinstance(ev, Heartbeat):
            self.on_heartbeat(ev)
        else:
            logger.error("unexpected %s on %s", type(ev).__name__, d.stream)
        self.bus.ack(d)

    def rebuild_queue(self) -> None:
        for rid, payload in self.r.hgetall(self.names.queue).items():
            ev = decode(payload)
            meta = self.r.hget(self.names.layer(rid.decode(), "meta"), "state")
            if meta is not None and meta.decode() == State.QUEUED.value and isinstance(ev, Preprocessed):
                self.queue.push(ev)
            else:
                self.r.hdel(self.names.queue, rid)

    def on_preprocessed(self, ev: Preprocessed) -> None:
        try:
            res = self.lifecycle.transition(ev.request_id, State.QUEUED)
        except InvalidTransition:
            return  # a redelivery of a request already queued or placed
        if res.applied:
            self.r.hset(self.names.queue, ev.request_id, encode(ev))
            self.queue.push(ev)

    def on_cancel(self, ev: CancelRequested) -> None:
        if self.queue.remove(ev.request_id) is not None:
            self.r.hdel(self.names.queue, ev.request_id)
            return
        worker = self.r.hget(self.names.layer(ev.request_id, "exec"), "worker_id")
        if worker:
            wid = msgspec.json.decode(worker)
            self.bus.publish(self.names.worker_stream(wid), msgspec.structs.replace(ev, worker_id=wid))

    def on_heartbeat(self, hb: Heartbeat) -> None:
        view = self.workers.get(hb.worker_id)
        if view is None:
            logger.info("worker %s joined (%d blocks, %d seqs)", hb.worker_id, hb.total_blocks, hb.max_num_seqs)
            self.workers[hb.worker_id] = WorkerView(hb.worker_id, hb, time.monotonic())
        else:
            view.observe(hb)

    def expire_deadlines(self) -> None:
        for q in self.queue.expired(time.time()):
            self.queue.remove(q.request_id)
            self.r.hdel(self.names.queue, q.request_id)
            out = TimedOut(request_id=q.request_id, where=State.QUEUED.value, service="scheduler",
                           traceparent=q.event.traceparent)
            self.lifecycle.transition(q.request_id, State.TIMED_OUT, "deadline", [Publish(q.event.reply_to, out)])

    def place(self) -> None:
        """Place queued requests in (priority, arrival) order while some live worker has room."""
        live = [w for w in self.workers.values() if w.alive(self.s.liveness_ttl_s)]
        while live and (head := self.queue.peek()) is not None:
            need = blocks_needed(len(head.event.prompt_token_ids) + len(head.output_token_ids), live[0].hb.block_size)
            fits = [w for w in live if w.free_slots(self.s.queue_slack) > 0]
            if not fits:
                return
            # Prefer a worker with KV room now; else the emptiest one (it will preempt or wait).
            best = max(fits, key=lambda w: (w.free_blocks() >= need, w.score(), -len(w.inflight)))
            self.queue.pop()
            self.send(head, best, need)

    def send(self, q, worker: WorkerView, need: int) -> None:
        ev = q.event
        out = Scheduled(request_id=ev.request_id, worker_id=worker.worker_id, reply_to=ev.reply_to,
                        prompt_token_ids=ev.prompt_token_ids, output_token_ids=q.output_token_ids,
                        sampling=ev.sampling, priority=ev.priority, deadline=ev.deadline, attempt=q.attempt,
                        traceparent=ev.traceparent)
        self.store.update(self.r, ev.request_id, "exec", {"worker_id": worker.worker_id, "attempt": q.attempt})
        res = self.lifecycle.transition(ev.request_id, State.SCHEDULED, "",
                                        [Publish(self.names.worker_stream(worker.worker_id), out)])
        self.r.hdel(self.names.queue, ev.request_id)
        if res.applied:
            worker.inflight[ev.request_id] = (res.entry_ids[0], need)
