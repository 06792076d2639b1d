"""How the scheduler sends placements and takes in requests: batched while tracing is off (a tick's new requests,
and its placements, each go to Redis in two pipelines instead of several round trips per request), one at a time
in their own spans while it is on (send_one).

At 5,000 concurrent streams the scheduler was a chain of one-at-a-time round trips (the QUEUED transition, the
deadline, the queue record, the acknowledgement; then the SCHEDULED transition, the queue record again, the
assignment), each slowed by a busy machine, and new requests piled up in PREPROCESSED. Order and effects per
request are those of the traced path (service.py): transitions first, the records they imply after, the
acknowledgement last, so a scheduler that dies in between leaves what a redelivery, sync() or the placement
repair (repair.py) finishes.
"""

from __future__ import annotations

import itertools
import logging

from services.scheduler.assignments import scheduled_event
from services.scheduler.recovery import Assignment
from services.scheduler.repair import retake_behind
from services.scheduler.routing import decision_fields
from shared import telemetry
from shared.events import Preprocessed
from shared.lifecycle import TERMINAL, Owner, Publish, State, TransitionResult

logger = logging.getLogger(__name__)

PLACE_BATCH = 256  # placements a tick sends at once: a bigger pipeline would hold Redis from token traffic
RESERVED = "0-0"  # in-flight entry id of a placement chosen but not yet sent (replaced, or dropped, when sent)
_placements = itertools.count()  # numbers this process's placements (their nonces)


def intake(svc, deliveries: list) -> None:
    """Queue a tick's preprocessed requests: their QUEUED transitions in one pipeline, their queue records and
    deadlines in a second, one XACK for all. Other events (cancels, hand-backs) are handled one by one."""
    new = [d for d in deliveries if isinstance(d.event, Preprocessed)]
    if new:
        pipe = svc.r.pipeline(transaction=False)
        for d in new:  # only from PREPROCESSED: a redelivery finds the request further along and moves nothing
            svc.lifecycle.queue(pipe, d.event.request_id, State.QUEUED, only_from=(State.PREPROCESSED,))
        replies = pipe.execute(raise_on_error=False)
        writes, done = svc.r.pipeline(transaction=False), []
        for d, raw in zip(new, replies):
            if isinstance(raw, Exception):  # left pending: retried, then dead-lettered
                logger.error("queueing %s failed: %r", d.event.request_id, raw)
                continue
            svc.after_queued(d.event, svc.lifecycle.interpret(d.event.request_id, State.QUEUED, raw), writes)
            done.append(d)
        writes.execute()
        svc.bus.ack_all(done)
    svc.bus.process_all([d for d in deliveries if not isinstance(d.event, Preprocessed)], svc.dispatch)


def send_all(svc, picks: list) -> None:
    """Send chosen placements (queued request, worker, blocks reserved, routing decision): their SCHEDULED
    transitions with the scheduled events in one pipeline, then (on a cluster) the events, then their records."""
    pipe, outs, laters = svc.r.pipeline(transaction=False), [], []
    for q, worker, _need, _decision in picks:
        out = scheduled_event(q, worker.worker_id, q.event.traceparent)
        # exec (worker, attempt: the fencing token) is written by the same atomic step
        laters.append(svc.lifecycle.queue(pipe, q.request_id, State.SCHEDULED, "",
                                          [Publish(svc.names.worker_stream(worker.worker_id), out)],
                                          only_from=(State.QUEUED,), owner=owner(svc, worker.worker_id, q.attempt)))
        outs.append(out)
    replies = pipe.execute(raise_on_error=False)
    sent = []  # (pick, event, result, events still to publish) of each placement made
    for (q, worker, need, decision), out, raw, later in zip(picks, outs, replies, laters):
        worker.drop_inflight(q.request_id)  # the reservation made while choosing
        if isinstance(raw, Exception):  # its queue record stays: the next sync reads everything, queues it again
            logger.error("placing %s failed: %r", q.request_id, raw)
            svc.replicas.full = True
            continue
        res = svc.lifecycle.interpret(q.request_id, State.SCHEDULED, raw)
        if res.applied:
            sent.append(((q, worker, need, decision), out, res, later))
        else:
            refused(svc, q, res)
    # On a cluster the scheduled events go to the inboxes now (their entry ids are what the records hold).
    results = svc.lifecycle.complete(svc.r, [(res, later) for _pick, _out, res, later in sent])
    record(svc, [(pick, out, res) for (pick, out, _res, _later), res in zip(sent, results)])


def send_one(svc, q, worker, need: int, decision) -> TransitionResult:
    """Send one placement (tracing on): its SCHEDULED transition with its scheduled event in a publish span,
    then its record."""
    ev = q.event
    stream = svc.names.worker_stream(worker.worker_id)
    with telemetry.publish_span(stream, ev.request_id) as pub:
        out = scheduled_event(q, worker.worker_id, telemetry.traceparent_of(pub, ev.traceparent))
        # exec (worker, attempt: the fencing token) is written by the same atomic step
        res = svc.lifecycle.transition(ev.request_id, State.SCHEDULED, "", [Publish(stream, out)],
                                       only_from=(State.QUEUED,), owner=owner(svc, worker.worker_id, q.attempt))
        telemetry.published(pub, res.entry_ids)
    if res.applied:
        record(svc, [((q, worker, need, decision), out, res)])
    else:
        refused(svc, q, res)
    return res


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
    for (q, worker, need, decision), out, res in placed:
        if not res.entry_ids:  # cannot happen unless its event was lost: repair.py finds it without an assignment
            logger.error("placement of %s has no event entry id: left to the repair", q.request_id)
            continue
        worker.add_inflight(q.request_id, res.entry_ids[0], need)
        a = Assignment(worker.worker_id, res.entry_ids[0], out)
        svc.assignments.record(a, writes)
        svc.store.update(writes, q.request_id, "exec", decision_fields(decision))
        todo.append(a)
    if todo:
        replies = writes.execute()
        for a, reply in zip(todo, replies[0::2]):
            svc.assignments.recorded(a, reply)
