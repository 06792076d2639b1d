"""What the scheduler does when a process it depends on disappears.

- Assignments (request -> worker, the `scheduled` event, its stream entry id) are kept in
  memory and in Redis (assignments.py), so a restarted scheduler still knows them; like the
  QUEUED records, each write is noted on a change stream, so other replicas read only what
  changed (sync.py).
- A worker whose heartbeat is older than the liveness TTL (dead, or hung: the heartbeat comes
  from its step loop) loses its requests: each goes back to the queue with the tokens it has
  already generated (the worker's token list), to be resumed on another worker. A cancel with
  reason worker_lost is left on its stream, so a hung worker that wakes up drops them.
- A gateway whose liveness entry is gone for longer than the TTL has lost its clients: their
  requests are cancelled (client_disconnect) so their KV blocks are freed -- all but the detached
  ones (background responses, meta `detached`): another gateway takes those over, and they run on.
"""

from __future__ import annotations

import logging
import time

import msgspec

from shared.wire.constants import Names
from shared.wire.events import CancelRequested, Cancelled, Preprocessed, Reason, Scheduled
from shared.state.lifecycle import Publish, State
from shared.process.runtime import Liveness

logger = logging.getLogger(__name__)

# Entries kept on each change stream of the shared hashes: a replica syncing every second reads everything again
# only if more than this many changes of one partition came between two of its syncs.
CHANGES_MAXLEN = 10_000


class Assignment(msgspec.Struct, frozen=True):
    worker_id: str  # worker it was sent to
    entry_id: str  # its entry on the worker's stream (read by the worker once <= its last_read_id)
    scheduled: Scheduled  # the placement, to place it again


class QueuedRecord(msgspec.Struct, frozen=True):
    """A queued request as stored in the `queue` hash: what any scheduler needs to place it."""

    event: Preprocessed  # the request as preprocessed
    deadline: float  # its deadline (adaptive ones are tighter than the event's cap)
    attempt: int = 1  # placements so far + 1
    output_token_ids: tuple[int, ...] = ()  # tokens generated before it was moved
    ahead: tuple[int, int] | None = None  # adaptive deadline: (prefill, decode) tokens queued ahead at arrival


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Assignment)
_qdec = msgspec.msgpack.Decoder(QueuedRecord)


def encode_queued(item) -> bytes:
    ahead = (item.ahead.prefill_tokens, item.ahead.decode_tokens) if item.ahead is not None else None
    return _enc.encode(QueuedRecord(item.event, item.deadline, item.attempt, item.output_token_ids, ahead))


def encode_record(rec: QueuedRecord) -> bytes:
    return _enc.encode(rec)


def decode_queued(payload: bytes) -> QueuedRecord:
    return _qdec.decode(payload)


def decode_assignment(payload: bytes) -> Assignment:
    return _dec.decode(payload)


def note_change(pipe, stream: str, request_id: str, writer: str) -> None:
    """After a write of a shared hash's field, on the same pipeline: the entry that tells the other replicas to
    read it again (services/scheduler/sync.py). In the hash's slot, so it never lands before the write."""
    pipe.xadd(stream, {"rid": request_id, "by": writer}, maxlen=CHANGES_MAXLEN, approximate=True)


class QueueRecords:
    """The QUEUED records every replica shares (one hash per partition), each write noted on the partition's
    change stream. pipe: the caller's pipeline (it executes it), else one of its own."""

    def __init__(self, client, names: Names, writer: str):
        self.r, self.names, self.writer = client, names, writer

    def put(self, request_id: str, payload: bytes, pipe=None, only_new: bool = False) -> None:
        p = self.names.partition(request_id)
        out = pipe if pipe is not None else self.r.pipeline(transaction=False)
        (out.hsetnx if only_new else out.hset)(self.names.queue(p), request_id, payload)
        note_change(out, self.names.queue_changes(p), request_id, self.writer)
        if pipe is None:
            out.execute()

    def drop(self, request_ids: list[str], pipe=None) -> None:
        out = pipe if pipe is not None else self.r.pipeline(transaction=False)
        for rid in request_ids:
            p = self.names.partition(rid)
            out.hdel(self.names.queue(p), rid)
            note_change(out, self.names.queue_changes(p), rid, self.writer)
        if pipe is None and request_ids:
            out.execute()

    def get(self, request_id: str) -> bytes | None:
        return self.r.hget(self.names.queue(self.names.partition(request_id)), request_id)


def gateway_of(reply_to: str) -> str:
    """The gateway id of a reply stream (shared.wire.constants.Names.reply_stream: its last part, in a hash tag)."""
    return reply_to.rsplit(":", 1)[-1].strip("{}")


def zombie_cancels(lost: list[Assignment]) -> list[tuple[str, CancelRequested]]:
    """Cancels to leave on a lost worker's stream, should it wake up."""
    return [
        (
            a.worker_id,
            CancelRequested(request_id=a.scheduled.request_id, reason=Reason.WORKER_LOST, worker_id=a.worker_id),
        )
        for a in lost
    ]


def requeue_undelivered(svc, over: list[Assignment]) -> None:
    """Placements a worker read past and does not hold are normally over. One still SCHEDULED never reached the
    worker: on a Redis Cluster its event goes to the inbox after the transition, and a failover can lose a write
    Redis had acknowledged. It is queued again (fenced: only from SCHEDULED, at its attempt)."""
    pipe = svc.r.pipeline(transaction=False)
    for a in over:
        pipe.hget(svc.names.layer(a.scheduled.request_id, "meta"), "state")
    for a, state in zip(over, pipe.execute()):
        if state == State.SCHEDULED.value.encode():
            logger.warning("%s never reached worker %s: queueing it again", a.scheduled.request_id, a.worker_id)
            svc.requeue(a.scheduled, a.scheduled.output_token_ids, Reason.LOST_IN_TRANSIT, only_from=(State.SCHEDULED,))


def recover_lost(svc) -> None:
    """Move the requests of workers that stopped heartbeating (back to the queue with their tokens, a cancel left
    on the worker's stream should it wake up); cancel those of gateways that died."""
    for w in [w for w in svc.workers.values() if not svc._alive(w)]:
        lost = svc.assignments.of_worker(w.worker_id)
        logger.warning(
            "worker %s lost (no heartbeat for %.1f s): moving %d requests",
            w.worker_id,
            time.monotonic() - w.seen_at,
            len(lost),
        )
        for a in lost:
            tokens = tuple(int(t) for t in svc.r.lrange(svc.names.tokens(a.scheduled.request_id), 0, -1))
            svc.requeue(a.scheduled, tokens, Reason.WORKER_LOST)
        for wid, cancel in zombie_cancels(lost):
            svc.bus.publish(svc.names.worker_stream(wid), cancel)
        svc.assignments.drop([a.scheduled for a in lost])
        del svc.workers[w.worker_id]
        svc.router.drop_worker(w.worker_id)
    svc.router.prune(set(svc.workers))
    live = set(Liveness.read(svc.r, svc.names, "gateway"))  # one HGETALL of the gateways' hash, no SCAN
    held = [(q.request_id, q.event.reply_to) for q in svc.queue.items()] + [
        (a.scheduled.request_id, a.scheduled.reply_to) for a in svc.assignments.by_request.values()
    ]
    dead = svc.gateways.dead(live, {gateway_of(reply) for _, reply in held})
    orphans = [(rid, reply) for rid, reply in held if gateway_of(reply) in dead]
    kept = detached(svc, [rid for rid, _ in orphans])
    for rid, reply in orphans:
        if rid not in kept:
            cancel_orphan(svc, rid, reply)


def detached(svc, request_ids: list[str]) -> set[str]:
    """Those of request_ids created detached (a background response: another gateway takes it over), read once
    each (one pipelined HGET of those not known yet) and kept while held; svc.detached_checked is cut to request_ids."""
    unknown = [rid for rid in request_ids if rid not in svc.detached_checked]
    if unknown:
        pipe = svc.r.pipeline(transaction=False)
        for rid in unknown:
            pipe.hget(svc.names.layer(rid, "meta"), "detached")
        for rid, flag in zip(unknown, pipe.execute()):
            svc.detached_checked[rid] = flag == b"true"
    svc.detached_checked = {rid: svc.detached_checked[rid] for rid in request_ids}  # held ones only: bounded
    return {rid for rid, flag in svc.detached_checked.items() if flag}


def cancel_orphan(svc, request_id: str, reply_to: str) -> None:
    """Its gateway is gone: settle CANCELLED, telling its reply stream (a gateway that comes back under the same
    id, and any reader of the stream, sees the end), and stop the work."""
    end = Cancelled(request_id=request_id, reason=Reason.CLIENT_DISCONNECT, service="scheduler")
    if svc._try(request_id, State.CANCELLED, Reason.CLIENT_DISCONNECT, [Publish(reply_to, end)]):
        logger.info("cancelled %s: its gateway is gone", request_id)
        svc.on_cancel(CancelRequested(request_id=request_id, reason=Reason.CLIENT_DISCONNECT))
