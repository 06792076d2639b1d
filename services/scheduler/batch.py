"""How the scheduler sends placements and takes in requests: batched while tracing is off (a tick's new requests,
and its placements, each go to Redis in two pipelines instead of several round trips per request), one at a time
in their own spans while it is on (send_one).

At 5,000 concurrent streams the scheduler was a chain of one-at-a-time round trips (the QUEUED transition, the
deadline, the queue record, the acknowledgement; then the SCHEDULED transition, the queue record again, the
assignment), each slowed by a busy machine, and new requests piled up in PREPROCESSED. Order and effects per
request are those of the traced path (service.py): transitions first, the records they imply after, the
acknowledgement last, so a scheduler that dies in between leaves what a redelivery or sync() repairs.
"""

from __future__ import annotations

import logging

from services.scheduler.recovery import Assignment
from services.scheduler.routing import decision_fields
from shared import telemetry
from shared.errors import InvalidTransition
from shared.events import Preprocessed, Scheduled
from shared.lifecycle import Owner, Publish, State, TransitionResult

logger = logging.getLogger(__name__)

PLACE_BATCH = 256  # placements a tick sends at once: a bigger pipeline would hold Redis from token traffic
RESERVED = "0-0"  # in-flight entry id of a placement chosen but not yet sent (replaced, or dropped, when sent)


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
            try:
                res = svc.lifecycle.interpret(d.event.request_id, State.QUEUED, raw)
            except InvalidTransition:
                done.append(d)  # a redelivery of a request already placed
                continue
            svc.after_queued(d.event, res, writes)
            done.append(d)
        writes.execute()
        svc.bus.ack_all(done)
    svc.bus.process_all([d for d in deliveries if not isinstance(d.event, Preprocessed)], svc.dispatch)


def send_all(svc, picks: list) -> None:
    """Send chosen placements (queued request, worker, blocks reserved, routing decision): their SCHEDULED transitions with the scheduled
    events in one pipeline, then the queue records dropped and the assignments recorded in a second."""
    pipe, outs, laters = svc.r.pipeline(transaction=False), [], []
    for q, worker, _need, _decision in picks:
        out = scheduled_event(q, worker.worker_id, q.event.traceparent)
        # exec (worker, attempt: the fencing token) is written by the same atomic step
        laters.append(svc.lifecycle.queue(pipe, q.request_id, State.SCHEDULED, "",
                                          [Publish(svc.names.worker_stream(worker.worker_id), out)],
                                          only_from=(State.QUEUED,), owner=Owner(worker.worker_id, q.attempt)))
        outs.append(out)
    replies = pipe.execute(raise_on_error=False)
    sent = []  # (pick, event, result, events still to publish) of each placement that reached Redis
    for (q, worker, need, decision), out, raw, later in zip(picks, outs, replies, laters):
        worker.drop_inflight(q.request_id)  # the reservation made while choosing
        if isinstance(raw, Exception):  # its queue record stays: the next sync reads everything, queues it again
            logger.error("placing %s failed: %r", q.request_id, raw)
            svc.replicas.full = True
            continue
        try:
            res = svc.lifecycle.interpret(q.request_id, State.SCHEDULED, raw)
        except InvalidTransition as e:  # another replica placed it already
            logger.info("not placing %s: %s", q.request_id, e)
            res = TransitionResult(False, None)
        sent.append(((q, worker, need, decision), out, res, later))
    # On a cluster the scheduled events go to the inboxes now (their entry ids are what after_send records).
    results = svc.lifecycle.complete(svc.r, [(res, later) for _pick, _out, res, later in sent])
    writes = svc.r.pipeline(transaction=False)
    for ((q, worker, need, decision), out, _res, _later), res in zip(sent, results):
        after_send(svc, q, worker, need, res, out, writes, decision)
    writes.execute()


def send_one(svc, q, worker, need: int, decision) -> TransitionResult:
    """Send one placement (tracing on): its SCHEDULED transition with its scheduled event in a publish span,
    then its records in one pipeline."""
    ev = q.event
    stream = svc.names.worker_stream(worker.worker_id)
    with telemetry.publish_span(stream, ev.request_id) as pub:
        out = scheduled_event(q, worker.worker_id, telemetry.traceparent_of(pub, ev.traceparent))
        try:  # exec (worker, attempt: the fencing token) is written by the same atomic step
            res = svc.lifecycle.transition(ev.request_id, State.SCHEDULED, "", [Publish(stream, out)],
                                           only_from=(State.QUEUED,), owner=Owner(worker.worker_id, q.attempt))
        except InvalidTransition as e:  # another replica placed it already
            logger.info("not placing %s: %s", ev.request_id, e)
            res = TransitionResult(False, None)
        telemetry.published(pub, res.entry_ids)
    writes = svc.r.pipeline(transaction=False)
    after_send(svc, q, worker, need, res, out, writes, decision)
    writes.execute()
    return res


def after_send(svc, q, worker, need: int, res: TransitionResult, out: Scheduled, pipe, decision) -> None:
    """After the SCHEDULED transition: drop the queue record; if placed, count it in flight to the worker (need:
    the blocks it must allocate there) and record the assignment and the routing decision (on pipe)."""
    svc.records.drop([q.request_id], pipe)
    if res.applied:
        worker.add_inflight(q.request_id, res.entry_ids[0], need)
        svc.assignments.add(Assignment(worker.worker_id, res.entry_ids[0], out), pipe)
        svc.store.update(pipe, q.request_id, "exec", decision_fields(decision))

def scheduled_event(q, worker_id: str, traceparent: str) -> Scheduled:
    """The placement of queued request q on a worker. The worker enforces the cap (the client's timeout, or the
    default one): an adaptive deadline bounds the wait in the queue, never a request its worker is making
    progress on."""
    ev = q.event
    return Scheduled(request_id=ev.request_id, worker_id=worker_id, reply_to=ev.reply_to,
                     prompt_token_ids=ev.prompt_token_ids, output_token_ids=q.output_token_ids, sampling=ev.sampling,
                     priority=ev.priority, deadline=ev.deadline, received_at=ev.received_at, attempt=q.attempt,
                     traceparent=traceparent, group_id=ev.group_id)
