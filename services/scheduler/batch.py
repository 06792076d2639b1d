"""How the scheduler takes in requests and sends placements: a tick's new requests, and its placements, each go to
Redis in two pipelines instead of several round trips per request. Traced, each request has its own spans all the
same (process, schedule, publish, queue), open until its writes are done: one path, traced or not.

At 5,000 concurrent streams the scheduler was a chain of one-at-a-time round trips (the QUEUED transition, the
deadline, the queue record, the acknowledgement; then the SCHEDULED transition, the queue record again, the
assignment), each slowed by a busy machine, and new requests piled up in PREPROCESSED. Order and effects per
request: transitions first, the records they imply after, the acknowledgement last, so a scheduler that dies in
between leaves what a redelivery, sync() or the placement repair (repair.py) finishes.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from opentelemetry.trace import Span

from services.scheduler.assignments import scheduled_event
from services.scheduler.recovery import Assignment
from services.scheduler.repair import retake_behind
from services.scheduler.routing import decision_fields
from services.scheduler.tracing import queue_span, start_schedule_span
from shared.process import telemetry
from shared.wire.events import Preprocessed
from shared.state.lifecycle import TERMINAL, Owner, Publish, State, TransitionResult

logger = logging.getLogger(__name__)

PLACE_BATCH = 256  # placements a tick sends at once: a bigger pipeline would hold Redis from token traffic
RESERVED = "0-0"  # in-flight entry id of a placement chosen but not yet sent (replaced, or dropped, when sent)
_placements = itertools.count()  # numbers this process's placements (their nonces)


@dataclass
class PickSpans:
    """A placement's spans, with tracing on: `schedule` (the choice), its `publish` (the scheduled event), and what
    the `queue` span needs (when the request became QUEUED)."""

    schedule: Span
    publish: Span
    queued_at: bytes | str | None


@dataclass
class Pick:
    """A placement chosen, to send: the queued request, its worker, the blocks reserved there, the routing
    decision, its spans (None with tracing off)."""

    q: object
    worker: object
    need: int
    decision: object
    spans: PickSpans | None = None


def intake(svc, deliveries: list) -> None:
    """Queue a tick's preprocessed requests: their QUEUED transitions in one pipeline, their queue records and
    deadlines in a second, one XACK for all (each in its own process span, traced). Other events (cancels,
    hand-backs) are handled one by one."""
    new = [d for d in deliveries if isinstance(d.event, Preprocessed)]
    if new:
        spans = [telemetry.start_process_span(d, svc.id) for d in new]
        try:
            pipe = svc.r.pipeline(transaction=False)
            for d in new:  # only from PREPROCESSED: a redelivery finds the request further along and moves nothing
                svc.lifecycle.queue(pipe, d.event.request_id, State.QUEUED, only_from=(State.PREPROCESSED,))
            replies = pipe.execute(raise_on_error=False)
            writes, done = svc.r.pipeline(transaction=False), []
            for d, raw, span in zip(new, replies, spans):
                if isinstance(raw, Exception):  # left pending: retried, then dead-lettered
                    logger.error("queueing %s failed: %r", d.event.request_id, raw)
                    continue
                with telemetry.current(span):  # the transition's event (and a refusal's) goes on it
                    svc.after_queued(d.event, svc.lifecycle.interpret(d.event.request_id, State.QUEUED, raw), writes)
                done.append(d)
            writes.execute()
        finally:
            telemetry.end_all(*spans)
        svc.bus.ack_all(done)
    svc.bus.process_all([d for d in deliveries if not isinstance(d.event, Preprocessed)], svc.dispatch)


def pick_spans(svc, q, worker, candidates, need: int, decision) -> PickSpans | None:
    """Open a placement's spans as it is chosen (None with tracing off): its schedule span, and in it the publish
    span whose traceparent the scheduled event carries."""
    if not telemetry.enabled():
        return None
    schedule = start_schedule_span(q, worker, candidates, need, decision)
    queued_at = svc.r.hget(svc.names.layer(q.request_id, "meta"), "state_since") if schedule.is_recording() else None
    with telemetry.current(schedule):
        publish = telemetry.start_publish_span(svc.names.worker_stream(worker.worker_id), q.request_id)
    return PickSpans(schedule, publish, queued_at)


def send_all(svc, picks: list[Pick]) -> None:
    """Send chosen placements: their SCHEDULED transitions with the scheduled events in one pipeline, then (on a
    cluster) the events, then their records; then their spans end."""
    try:
        pipe, outs, laters = svc.r.pipeline(transaction=False), [], []
        for p in picks:
            out = scheduled_event(
                p.q, p.worker.worker_id, telemetry.traceparent_of(p.spans and p.spans.publish, p.q.event.traceparent)
            )
            # exec (worker, attempt: the fencing token) is written by the same atomic step
            laters.append(
                svc.lifecycle.queue(
                    pipe,
                    p.q.request_id,
                    State.SCHEDULED,
                    "",
                    [Publish(svc.names.worker_stream(p.worker.worker_id), out)],
                    only_from=(State.QUEUED,),
                    owner=owner(svc, p.worker.worker_id, p.q.attempt),
                )
            )
            outs.append(out)
        sent = _interpret(svc, picks, outs, pipe.execute(raise_on_error=False), laters)
        # On a cluster the scheduled events go to the inboxes now (their entry ids are what the records hold).
        results = svc.lifecycle.complete(svc.r, [(res, later) for _p, _out, res, later in sent])
        placed = [(p, out, res) for (p, out, _res, _later), res in zip(sent, results)]
        for p, _out, res in placed:
            if p.spans is not None:
                telemetry.published(p.spans.publish, res.entry_ids)
                queue_span(p.q, p.spans.queued_at, res)
        record(svc, placed)
    finally:
        for p in picks:
            if p.spans is not None:
                telemetry.end_all(p.spans.publish, p.spans.schedule)


def _interpret(svc, picks: list[Pick], outs: list, replies: list, laters: list) -> list:
    """The placements' replies: (pick, event, result, events still to publish) of each one made; the others
    refused (or left to the next sync, when Redis failed them)."""
    sent = []
    for p, out, raw, later in zip(picks, outs, replies, laters):
        p.worker.drop_inflight(p.q.request_id)  # the reservation made while choosing
        if isinstance(raw, Exception):  # its queue record stays: the next sync reads everything, queues it again
            logger.error("placing %s failed: %r", p.q.request_id, raw)
            svc.replicas.full = True
            continue
        with telemetry.current(p.spans and p.spans.publish):  # the transition's event goes on it
            res = svc.lifecycle.interpret(p.q.request_id, State.SCHEDULED, raw)
        if res.applied:
            sent.append((p, out, res, later))
        else:
            refused(svc, p.q, res)
    return sent


def owner(svc, worker_id: str, attempt: int) -> Owner:
    """The placement's fencing token, named so that its own script re-sent (a lost reply) tells itself apart."""
    return Owner(worker_id, attempt, f"{svc.replicas.writer}.{next(_placements)}")


def refused(svc, q, res: TransitionResult) -> None:
    """A placement Redis refused. Fenced: Redis holds a later attempt than this replica's record (repair.py takes
    that one). Ended or gone: its queue record is dropped. Refused (on a worker, or not yet QUEUED): another
    replica's placement (it drops the record when it records its placement)."""
    if res.refused:
        logger.info("not placing %s: it is %s", q.request_id, res.previous.value)
    elif res.fenced:
        retake_behind(svc, q)
    elif res.previous is None or res.previous in TERMINAL:
        svc.records.drop([q.request_id])


def record(svc, placed: list) -> None:
    """After the SCHEDULED transitions (and, on a cluster, their events): count each placement in flight to its
    worker (need: the blocks it must allocate there), then record it (the assignment written, the queue record
    dropped: one script each, assignments.py) with its routing decision, in one pipeline. Known here only once
    recorded; one refused there (the request moved on meanwhile) is not."""
    writes, todo = svc.r.pipeline(transaction=False), []
    for p, out, res in placed:
        if not res.entry_ids:  # cannot happen unless its event was lost: repair.py finds it without an assignment
            logger.error("placement of %s has no event entry id: left to the repair", p.q.request_id)
            continue
        p.worker.add_inflight(p.q.request_id, res.entry_ids[0], p.need)
        a = Assignment(p.worker.worker_id, res.entry_ids[0], out)
        svc.assignments.record(a, writes)
        svc.store.update(writes, p.q.request_id, "exec", decision_fields(p.decision))
        todo.append(a)
    if todo:
        replies = writes.execute()
        for a, reply in zip(todo, replies[0::2]):
            svc.assignments.recorded(a, reply)
