"""Finishing, from what Redis holds, a placement a scheduler was cut short in (issue 24, item 7).

A placement is three steps (assignments.py): the SCHEDULED transition, its event on the worker's inbox (on a Redis
Cluster a write of its own, after the transition), its record (the assignment written and the queue record dropped,
one script). A scheduler killed between them, or a script re-sent after its reply was lost, left a request
SCHEDULED with no assignment: nothing would ever move it (a worker's loss is acted on through its assignments), and
on a cluster its worker may never have got it, so it sat until its cap (504). The record script keeps the queue
record until the assignment is written, so such a request still has, in its own slot, its attempt and worker (exec)
and its queue record at that attempt. Two paths finish it:

- held (the main loop, on each heartbeat: HeldUnknown): a request a worker holds that no placement known here
  names, for longer than CONVEYOR_PLACEMENT_GRACE_S (a sync brings another replica's placements within a second),
  is recorded from its queue record, with the heartbeat's last read id (the worker has read its event);
- swept (the janitor's thread: PlacementSweep): a request SCHEDULED for longer than 4 graces without an
  assignment either has its event on its worker's inbox (the placement is recorded with that entry), or not (it
  never went out: it is queued again at the next attempt, fenced by its own, so a late worker's writes are refused).

A placement refused as stale (Redis holds a later attempt than the record it was made from) is queued again at the
attempt Redis holds (retake_behind), never left being refused until its deadline.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import msgspec

from services.scheduler.assignments import Assignments, scheduled_event
from services.scheduler.recovery import (
    Assignment,
    QueueRecords,
    QueuedRecord,
    decode_queued,
    encode_queued,
    encode_record,
)
from services.scheduler.sync import ON_A_WORKER
from shared.wire.bus import plain_events
from shared.wire.constants import Names
from shared.wire.events import Failed, Heartbeat, Reason, Scheduled
from shared.state.lifecycle import Lifecycle, Publish, State
from shared.settings import SchedulerSettings
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)

# The sweep waits this many graces (20 s by default): the held path finds first what a worker has read, and a
# placement whose event is still being sent (a cluster client retries for up to CLUSTER_RETRY_S, 10 s, through a
# failover) is not queued again under its scheduler.
SWEEP_GRACES = 4
SKEW_MS = 5_000  # an inbox's entry ids are its master's clock, the SCHEDULED time the request's: they may differ
PAGE = 100  # inbox entries read at once looking for a placement's event
MAX_PAGES = 10  # its event is within the first 1,000 entries after its placement, or its worker is far behind
BATCH = 500  # SCHEDULED ids read at once per partition
MAX_BATCHES = 20  # per partition and sweep: what a sweep leaves, the next one reads


class Found(NamedTuple):
    """What Redis holds of one request's placement."""

    request_id: str
    state: str | None
    attempt: int  # exec.attempt (0: none)
    worker_id: str  # exec.worker_id ("": none)
    assigned: bool  # an assignment is recorded
    record: QueuedRecord | None  # its queue record, at whatever attempt


def read_placements(client, names: Names, rids: list[str]) -> list[Found]:
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        p = names.partition(rid)
        pipe.hget(names.layer(rid, "meta"), "state")
        pipe.hmget(names.layer(rid, "exec"), "attempt", "worker_id")
        pipe.hexists(names.assigned(p), rid)
        pipe.hget(names.queue(p), rid)
    got = pipe.execute()
    out = []
    for i, rid in enumerate(rids):
        state, (attempt, worker), assigned, raw = got[4 * i : 4 * i + 4]
        out.append(
            Found(
                rid,
                as_text(state) if state else None,
                int(attempt) if attempt else 0,
                msgspec.json.decode(worker) if worker else "",
                bool(assigned),
                decode_queued(raw) if raw else None,
            )
        )
    return out


def recordable(f: Found, worker_id: str) -> bool:
    """Whether f is a placement on worker_id with no assignment and its queue record at its attempt."""
    return (
        not f.assigned
        and f.worker_id == worker_id
        and f.state in ON_A_WORKER
        and f.record is not None
        and f.record.attempt == f.attempt
    )


class HeldUnknown:
    """The held path (module docstring): a set difference per heartbeat; Redis is read only for ids unknown here
    for longer than the grace, and each such id again only a grace later."""

    def __init__(self, svc, grace_s: float):
        self.svc, self.grace_s = svc, grace_s
        self.since: dict[str, dict[str, float]] = {}  # worker -> request it holds, known to no placement -> since

    def on_heartbeat(self, hb: Heartbeat) -> None:
        known, now = self.svc.assignments.by_request, time.monotonic()
        for gone in [w for w in self.since if w not in self.svc.workers and w != hb.worker_id]:
            del self.since[gone]  # a worker judged lost: what it held is moved through its assignments
        before = self.since.pop(hb.worker_id, {})
        unknown = {rid: before.get(rid, now) for rid in hb.request_ids if rid not in known}
        due = [rid for rid, t in unknown.items() if now - t >= self.grace_s]
        if unknown:
            self.since[hb.worker_id] = unknown
        if due and hb.last_read_id:
            unknown.update({rid: now for rid in due})
            self._record(hb, due)

    def _record(self, hb: Heartbeat, rids: list[str]) -> None:
        svc = self.svc
        for f in read_placements(svc.r, svc.names, rids):
            if not recordable(f, hb.worker_id):
                continue  # another replica's placement (its sync is due), or no longer this worker's attempt
            a = Assignment(
                hb.worker_id, hb.last_read_id, scheduled_event(f.record, hb.worker_id, f.record.event.traceparent)
            )
            if svc.assignments.add(a):
                logger.warning(
                    "%s runs on %s with no placement recorded (its scheduler was cut short): recorded",
                    f.request_id,
                    hb.worker_id,
                )


class PlacementSweep:
    """The swept path (module docstring): a chore of the janitor's thread, on a Redis client of its own. Its writes
    are named by a writer of their own, so its own scheduler's sync reads them as another replica's."""

    def __init__(self, client, names: Names, writer: str, settings: SchedulerSettings):
        self.r, self.names = client, names
        self.grace_s, self.max_attempts = settings.placement_grace_s * SWEEP_GRACES, settings.max_attempts
        self.lifecycle = Lifecycle(client, names, "scheduler", settings.context_ttl_s)
        self.assignments = Assignments(client, names, writer)
        self.records = QueueRecords(client, names, writer)

    def sweep(self) -> int:
        """One pass over the partitions' requests SCHEDULED for longer than the grace; returns those finished."""
        late = self._unassigned(time.time() - self.grace_s)
        if not late:
            return 0
        found = read_placements(self.r, self.names, [rid for rid, _since in late])
        return sum(self._finish(f, since) for f, (_rid, since) in zip(found, late))

    def _unassigned(self, cutoff: float) -> list[tuple[str, float]]:
        """(id, SCHEDULED since) of the requests SCHEDULED before cutoff with no assignment: a batch per partition
        in one round trip, their assignments looked up in a second."""
        n, todo, out = self.names, {p: 0 for p in self.names.all_partitions}, []
        for _ in range(MAX_BATCHES):
            if not todo:
                break
            pipe = self.r.pipeline(transaction=False)
            for p, skip in todo.items():
                pipe.zrangebyscore(
                    n.state_set(p, State.SCHEDULED.value), "-inf", cutoff, start=skip, num=BATCH, withscores=True
                )
            found = [(p, [(as_text(rid), since) for rid, since in ids]) for p, ids in zip(todo, pipe.execute())]
            pipe = self.r.pipeline(transaction=False)
            for p, ids in found:
                for rid, _since in ids:
                    pipe.hexists(n.assigned(p), rid)
            has = iter(pipe.execute())
            for p, ids in found:
                out += [(rid, since) for (rid, since), h in zip(ids, [next(has) for _ in ids]) if not h]
            todo = {p: todo[p] + BATCH for p, ids in found if len(ids) == BATCH}
        return out

    def _finish(self, f: Found, since: float) -> int:
        if f.state != State.SCHEDULED.value or f.assigned or not f.worker_id:
            return 0  # moved on, or recorded, since it was listed
        sent = self._on_inbox(f, since)
        if sent is not None:
            if self.assignments.add(Assignment(f.worker_id, *sent)):
                logger.warning(
                    "%s was placed on %s with no record (its scheduler was cut short): recorded from its event",
                    f.request_id,
                    f.worker_id,
                )
                return 1
            return 0
        if f.record is None or f.record.attempt != f.attempt:
            logger.error(
                "%s is SCHEDULED on %s with no assignment, no event on its inbox and no queue record: it "
                "cannot be placed again",
                f.request_id,
                f.worker_id,
            )
            return 0
        return self._requeue(f)

    def _on_inbox(self, f: Found, since: float) -> tuple[str, Scheduled] | None:
        """(entry id, event) of the placement's event on its worker's inbox, if it is there."""
        stream, start = self.names.worker_stream(f.worker_id), f"{max(0, int(since * 1000) - SKEW_MS)}-0"
        for _ in range(MAX_PAGES):
            entries = self.r.xrange(stream, min=start, max="+", count=PAGE)
            for entry_id, ev in plain_events(entries, "inbox"):
                if isinstance(ev, Scheduled) and ev.request_id == f.request_id and ev.attempt == f.attempt:
                    return entry_id, ev
            if len(entries) < PAGE:
                return None
            start = f"({as_text(entries[-1][0])}"
        return None

    def _requeue(self, f: Found) -> int:
        """Its event never went out: queued again at the next attempt (or failed, past the most attempts), fenced
        by its attempt and only from SCHEDULED, so a worker that got it after all is refused, and a second sweep
        (or another replica's) changes nothing."""
        rec, rid, fence = f.record, f.request_id, {"fence": f.attempt, "only_from": (State.SCHEDULED,)}
        if f.attempt >= self.max_attempts:
            fail = Failed(
                request_id=rid,
                reason=Reason.WORKER_LOST,
                service="scheduler",
                message=f"the request could not be placed after {f.attempt} attempts; giving up",
                traceparent=rec.event.traceparent,
            )
            res = self.lifecycle.transition(
                rid, State.FAILED, Reason.WORKER_LOST, [Publish(rec.event.reply_to, fail)], **fence
            )
        else:
            res = self.lifecycle.transition(rid, State.QUEUED, Reason.LOST_IN_TRANSIT, (), **fence)
        if res.refused:  # its worker moved it on meanwhile
            logger.info("not requeueing %s: it is %s", rid, res.previous.value)
        if not res.applied:
            return 0
        if f.attempt >= self.max_attempts:
            self.records.drop([rid])
            return 1
        tokens = tuple(int(t) for t in self.r.lrange(self.names.tokens(rid), 0, -1))
        self.records.put(
            rid, encode_record(msgspec.structs.replace(rec, attempt=f.attempt + 1, output_token_ids=tokens))
        )
        logger.warning(
            "%s never reached worker %s (its scheduler was cut short): queued again at attempt %d",
            rid,
            f.worker_id,
            f.attempt + 1,
        )
        return 1


def retake_behind(svc, q) -> None:
    """A placement of queued item q refused as stale: Redis holds a later attempt than q's. Another replica requeued
    the request (its record, newer, is taken), or a requeue was cut short between its transition and its record
    (the record is written now, at the attempt after exec's, with the tokens so far)."""
    [f] = read_placements(svc.r, svc.names, [q.request_id])
    if f.state != State.QUEUED.value:
        return  # placed or ended by another replica: its records say so at the next sync
    if f.record is not None and f.record.attempt > f.attempt:
        svc.push_record(f.record)
        return
    tokens = tuple(int(t) for t in svc.r.lrange(svc.names.tokens(q.request_id), 0, -1))
    item = svc.queue.push(q.event, f.attempt + 1, tokens, q.deadline, q.ahead)
    if item is not None:
        svc.records.put(q.request_id, encode_queued(item))
        logger.warning(
            "%s was QUEUED with a record behind its attempt %d: queued again at %d",
            q.request_id,
            f.attempt,
            f.attempt + 1,
        )
