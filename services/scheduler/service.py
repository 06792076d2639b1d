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

from services.scheduler.recovery import (Assignment, Assignments, GatewayWatch, decode_queued, encode_queued,
                                         gateway_of, zombie_cancels)
from services.scheduler.tracing import queue_span, schedule_span
from services.scheduler.state import RequestQueue, WorkerView, blocks_needed
from shared import telemetry
from shared.bus import Bus, Delivery, event_field
from shared.constants import EVENT_FIELD, GROUP_SCHEDULER, Names
from shared.context_store import ContextJanitor, ContextStore
from shared.errors import InvalidTransition
from shared.events import CancelRequested, Failed, HandBack, Heartbeat, Preprocessed, Scheduled, SchemaError, TimedOut, decode
from shared.lifecycle import Lifecycle, Publish, State
from shared.redis_client import sync_client
from shared.runtime import Liveness, StopFlag, instance_id, run_loop
from shared.settings import SchedulerSettings

logger = logging.getLogger(__name__)


class SchedulerService:
    def __init__(self, settings: SchedulerSettings):
        self.s = settings
        self.names = Names(settings.namespace)
        self.r = sync_client(settings)
        self.id = instance_id(settings, "scheduler")
        self.bus = Bus(self.r, self.names, self.id, settings.read_block_ms, settings.claim_idle_ms,
                       settings.max_deliveries, on_dead=self._on_dead)
        self.lifecycle = Lifecycle(self.r, self.names, "scheduler", settings.context_ttl_s)
        self.store = ContextStore(self.r, self.names, settings.context_ttl_s)
        self.queue = RequestQueue()
        self.assignments = Assignments(self.r, self.names.assigned)
        self.gateways = GatewayWatch(settings.liveness_ttl_s)
        self.workers: dict[str, WorkerView] = {}
        self.live = Liveness(self.names, "scheduler", self.id, settings.heartbeat_interval_s,
                             settings.liveness_ttl_s)
        # Heartbeats are read by every replica (plain XREAD), the other streams shared through the group.
        self.streams = [self.names.preprocessed_stream, self.names.control_stream]
        # Start with the heartbeats of the last TTL, so a restarted scheduler knows the workers at once.
        self.hb_cursor = f"{int((time.time() - settings.liveness_ttl_s) * 1000)}-0"
        self.janitor = ContextJanitor(self.r, self.names, settings.context_ttl_s, settings.max_ended_contexts)
        self._swept_at = 0.0

    def run(self) -> None:
        stop = StopFlag()
        for stream in self.streams:
            self.bus.ensure_group(stream, GROUP_SCHEDULER)
        self.sync()
        logger.info("scheduler %s started, %d queued", self.id, len(self.queue))
        run_loop(stop, self.tick, "scheduler")
        self.live.clear(self.r)

    def tick(self) -> None:
        """Read, dispatch, then act on time (deadlines, lost workers) and place what fits."""
        deliveries = self.bus.read(self.streams, GROUP_SCHEDULER)
        if self.live.due():
            deliveries += [d for s in self.streams for d in self.bus.sweep(s, GROUP_SCHEDULER)]
            self.live.refresh(self.r, {"queued": len(self.queue)})
            self.sync()
            self.recover_lost()
        for d in deliveries:
            self.bus.process(d, self.dispatch)
        self.read_heartbeats()
        self.expire_deadlines()
        self.place()

    def dispatch(self, d: Delivery) -> None:
        ev = d.event
        if isinstance(ev, Preprocessed):
            self.on_preprocessed(ev)
        elif isinstance(ev, CancelRequested):
            self.on_cancel(ev)
        elif isinstance(ev, HandBack):
            self.assignments.drop([ev.request_id])
            self.requeue(ev.scheduled, ev.output_token_ids, ev.reason)
        else:
            logger.error("unexpected %s on %s", type(ev).__name__, d.stream)

    def sync(self) -> None:
        """Align with what Redis holds: queued requests and placements are shared by every scheduler replica
        (a restarted or surviving one adopts those of a dead one); placement is compare-and-set, so two
        replicas holding one request never place it twice."""
        self.assignments.load()
        for a in self.assignments.by_request.values():
            self.workers.setdefault(a.worker_id, WorkerView(a.worker_id, None, time.monotonic()))
        stored = {rid.decode(): payload for rid, payload in self.r.hgetall(self.names.queue).items()}
        for rid in [q.request_id for q in self.queue.items() if q.request_id not in stored]:
            self.queue.remove(rid)  # placed or cancelled by another replica
        missing = [rid for rid in stored if rid not in self.queue]
        pipe = self.r.pipeline(transaction=False)
        for rid in missing:
            pipe.hget(self.names.layer(rid, "meta"), "state")
        for rid, state in zip(missing, pipe.execute()):
            if state is not None and state.decode() == State.QUEUED.value:
                rec = decode_queued(stored[rid])
                self.queue.push(rec.event, rec.attempt, rec.output_token_ids, rec.deadline)
            else:  # placed, ended or expired meanwhile
                self.r.hdel(self.names.queue, rid)

    def on_preprocessed(self, ev: Preprocessed) -> None:
        try:
            res = self.lifecycle.transition(ev.request_id, State.QUEUED)
        except InvalidTransition:
            return  # a redelivery of a request already queued or placed
        # Not applied but QUEUED: a scheduler died between the transition and storing the queue record
        # (this is its redelivered event); finish its work, or the request would sit QUEUED forever.
        if res.applied or res.previous == State.QUEUED:
            item = self.queue.push(ev)
            if item is not None and ev.adaptive_deadline:
                self.set_adaptive_deadline(item)
            if item is not None:
                store = self.r.hset if res.applied else self.r.hsetnx
                store(self.names.queue, ev.request_id, encode_queued(item))

    def set_adaptive_deadline(self, item) -> None:
        """Deadline = arrival + factor x predicted time (work ahead shared by every slot, then its own),
        from the costs the workers measure; clamped to [timeout_min_s, timeout_max_s] and the gateway's cap."""
        live = [w for w in self.workers.values() if self._alive(w)]
        if not live:
            return  # nothing measured yet: keep the cap
        prefill = sum(w.hb.prefill_s_per_token for w in live) / len(live)
        decode = sum(w.hb.step_time_s or w.hb.decode_s_per_token for w in live) / len(live)
        slots = max(1, sum(w.hb.max_num_seqs for w in live))
        ahead = sum(q.cost(prefill, decode) for q in self.queue.ahead_of(item)) / slots
        predicted = ahead + item.cost(prefill, decode)
        budget = min(max(self.s.timeout_safety_factor * predicted, self.s.timeout_min_s), self.s.timeout_max_s)
        item.deadline = min(item.event.deadline, item.event.received_at + budget)
        self.store.update(self.r, item.request_id, "meta", {"deadline": item.deadline, "predicted_s": predicted})

    def requeue(self, sch: Scheduled, output_token_ids: tuple[int, ...], reason: str) -> None:
        """Put a request that left its worker back in the queue; the next worker resumes after
        output_token_ids. Each move counts as an attempt; past max_attempts the request fails."""
        if sch.attempt >= self.s.max_attempts:
            fail = Failed(request_id=sch.request_id, reason="worker_lost", service="scheduler",
                          message=f"the request lost its worker {sch.attempt} times ({reason}); giving up",
                          traceparent=sch.traceparent)
            self.lifecycle.transition(sch.request_id, State.FAILED, "worker_lost", [Publish(sch.reply_to, fail)])
            return
        res = self.lifecycle.transition(sch.request_id, State.QUEUED, reason)
        if not res.applied:
            return  # settled meanwhile (cancelled, timed out)
        ev = Preprocessed(request_id=sch.request_id, reply_to=sch.reply_to, prompt_token_ids=sch.prompt_token_ids,
                          sampling=sch.sampling, priority=sch.priority, deadline=sch.deadline,
                          received_at=sch.received_at, traceparent=sch.traceparent)
        # Ahead of newer arrivals of its priority: it keeps its original arrival time.
        item = self.queue.push(ev, attempt=sch.attempt + 1, output_token_ids=output_token_ids, deadline=sch.deadline)
        if item is not None:
            self.r.hset(self.names.queue, sch.request_id, encode_queued(item))
        logger.info("requeued %s (%s) with %d tokens done, attempt %d", sch.request_id, reason,
                    len(output_token_ids), sch.attempt + 1)

    def on_cancel(self, ev: CancelRequested) -> None:
        if self.queue.remove(ev.request_id) is not None:
            self.r.hdel(self.names.queue, ev.request_id)
            return
        worker = self.r.hget(self.names.layer(ev.request_id, "exec"), "worker_id")
        if worker:
            wid = msgspec.json.decode(worker)
            self.bus.publish(self.names.worker_stream(wid), msgspec.structs.replace(
                ev, worker_id=wid, traceparent=telemetry.current_traceparent(ev.traceparent)))

    def read_heartbeats(self) -> None:
        reply = self.r.xread({self.names.heartbeat_stream: self.hb_cursor}, count=1000)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.hb_cursor = entry_id.decode()
                try:
                    ev = decode(fields[EVENT_FIELD])
                except (SchemaError, KeyError) as e:
                    logger.error("unreadable heartbeat skipped: %s", e)
                    continue
                if isinstance(ev, Heartbeat):
                    self.on_heartbeat(ev)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        view = self.workers.get(hb.worker_id)
        self.assignments.settle_with_heartbeat(hb.worker_id, hb.request_ids, hb.last_read_id)
        if view is None or view.hb is None:
            logger.info("worker %s joined (%d blocks, %d seqs)", hb.worker_id, hb.total_blocks, hb.max_num_seqs)
            self.workers[hb.worker_id] = WorkerView(hb.worker_id, hb, time.monotonic())
        else:
            view.observe(hb)

    def _on_dead(self, stream: str, event, why: str) -> None:
        """A poison entry: fail its request (if it names one) so its client gets an answer."""
        rid, reply_to = event_field(event, "request_id"), event_field(event, "reply_to")
        if not isinstance(rid, str) or not isinstance(reply_to, str):
            return
        self.queue.remove(rid)
        fail = Failed(request_id=rid, reason="internal", service="scheduler",
                      message=f"the scheduler could not process this request ({why})")
        try:
            self.lifecycle.transition(rid, State.FAILED, "internal", [Publish(reply_to, fail)])
        except InvalidTransition as e:
            logger.error("cannot fail dead-lettered %s: %s", rid, e)

    def expire_deadlines(self) -> None:
        now = time.time()
        if now - self._swept_at >= self.s.janitor_interval_s:
            self._swept_at = now
            self.janitor.sweep(now)
        for q in self.queue.expired(now):
            self.queue.remove(q.request_id)
            self.r.hdel(self.names.queue, q.request_id)
            out = TimedOut(request_id=q.request_id, where=State.QUEUED.value, service="scheduler",
                           traceparent=q.event.traceparent)
            self.lifecycle.transition(q.request_id, State.TIMED_OUT, "deadline", [Publish(q.event.reply_to, out)])

    def place(self) -> None:
        """Place queued requests in (priority, arrival) order while some live worker has room."""
        live = [w for w in self.workers.values() if w.hb is not None and self._alive(w)]
        while live and (head := self.queue.peek()) is not None:
            need = blocks_needed(len(head.event.prompt_token_ids) + len(head.output_token_ids), live[0].hb.block_size)
            fits = [w for w in live if w.free_slots(self.s.queue_slack) > 0]
            if not fits:
                return
            # Prefer a worker with KV room now; else the emptiest one (it will preempt or wait).
            best = max(fits, key=lambda w: (w.free_blocks() >= need, w.score(), -len(w.inflight)))
            self.queue.pop()
            with schedule_span(head, best, fits, need) as span:
                queued_at = self.r.hget(self.names.layer(head.request_id, "meta"), "state_since") \
                    if span.is_recording() else None
                res = self.send(head, best, need)
                queue_span(head, queued_at, res)

    def send(self, q, worker: WorkerView, need: int):
        ev = q.event
        stream = self.names.worker_stream(worker.worker_id)
        with telemetry.publish_span(stream, ev.request_id) as pub:
            out = Scheduled(request_id=ev.request_id, worker_id=worker.worker_id, reply_to=ev.reply_to,
                            prompt_token_ids=ev.prompt_token_ids, output_token_ids=q.output_token_ids,
                            sampling=ev.sampling, priority=ev.priority, deadline=q.deadline,
                            received_at=ev.received_at, attempt=q.attempt,
                            traceparent=telemetry.traceparent_of(pub, ev.traceparent))
            res = self.lifecycle.transition(ev.request_id, State.SCHEDULED, "", [Publish(stream, out)])
            telemetry.published(pub, res.entry_ids)
        self.r.hdel(self.names.queue, ev.request_id)
        if res.applied:
            self.store.update(self.r, ev.request_id, "exec", {"worker_id": worker.worker_id, "attempt": q.attempt})
            worker.inflight[ev.request_id] = (res.entry_ids[0], need)
            self.assignments.add(Assignment(worker.worker_id, res.entry_ids[0], out))
        return res

    def _alive(self, w: WorkerView) -> bool:
        return w.alive(self.s.liveness_ttl_s, self.s.worker_hang_timeout_s)

    def recover_lost(self) -> None:
        """Move the requests of workers that stopped heartbeating; cancel those of gateways that died."""
        for w in [w for w in self.workers.values() if not self._alive(w)]:
            lost = self.assignments.of_worker(w.worker_id)
            logger.warning("worker %s lost (no heartbeat for %.1f s): moving %d requests", w.worker_id,
                           time.monotonic() - w.seen_at, len(lost))
            for a in lost:
                tokens = tuple(int(t) for t in self.r.lrange(self.names.tokens(a.scheduled.request_id), 0, -1))
                self.requeue(a.scheduled, tokens, "worker_lost")
            for wid, cancel in zombie_cancels(lost):
                self.bus.publish(self.names.worker_stream(wid), cancel)
            self.assignments.drop([a.scheduled.request_id for a in lost])
            del self.workers[w.worker_id]
        live = {k.decode().rsplit(":", 1)[1] for k in self.r.scan_iter(self.names.live_pattern("gateway"))}
        held = [(q.request_id, q.event.reply_to) for q in self.queue.items()] + \
            [(a.scheduled.request_id, a.scheduled.reply_to) for a in self.assignments.by_request.values()]
        dead = self.gateways.dead(live, {gateway_of(reply) for _, reply in held})
        for rid, reply in held:
            if gateway_of(reply) in dead:
                self.cancel_orphan(rid)

    def cancel_orphan(self, request_id: str) -> None:
        res = self.lifecycle.transition(request_id, State.CANCELLED, "client_disconnect")
        if res.applied:
            logger.info("cancelled %s: its gateway is gone", request_id)
            self.on_cancel(CancelRequested(request_id=request_id, reason="client_disconnect"))
