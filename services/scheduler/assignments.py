"""The placements (request -> worker, its `scheduled` event, that event's entry id), in memory and in one hash per
partition every replica shares, each write noted on the partition's change stream (sync.py reads them).

A placement is made in steps (docs/reliability.md, "Placement, step by step"): the SCHEDULED transition (with its
event on a single Redis), its event on the worker's inbox (on a Redis Cluster, another slot), then its record. The
record is one script in the request's slot: the assignment written and the queue record dropped together, only
while exec.attempt is still the placement's. So a request on a worker without an assignment still has its queue
record at that attempt, and what a scheduler killed between the steps left can be finished from Redis (repair.py).
A drop is fenced the same way: a replica with a stale copy (an earlier attempt) never erases a newer placement.
"""

from __future__ import annotations

import logging

import msgspec

from services.scheduler.recovery import CHANGES_MAXLEN, Assignment
from shared.wire.bus import entry_key
from shared.wire.constants import Names
from shared.wire.events import Scheduled
from shared.state.lifecycle import TERMINAL, State, lua_in

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()

# KEYS: exec, meta, assigned, assigned changes, queue, queue changes (the request's partition: one slot).
# ARGV: request id, the placement's attempt, the assignment, writer, changes maxlen.
# 'fenced': exec.attempt is another attempt's (placed again since; or the context is gone): nothing written.
# 'moved': QUEUED again since (handed back, or its worker lost): the queue record is the next attempt's, kept.
# 'over': ended since: no assignment, the record dropped. 'recorded': both done (a re-run changes nothing).
_RECORD_LUA = """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[2] then return 'fenced' end
local st = redis.call('HGET', KEYS[2], 'state')
if st == '@QUEUED' then return 'moved' end
if redis.call('HDEL', KEYS[5], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'rid', ARGV[1], 'by', ARGV[4])
end
if @TERMINAL(st) then return 'over' end
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[3] then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'rid', ARGV[1], 'by', ARGV[4])
end
return 'recorded'
""".replace("@TERMINAL(st)", lua_in("st", TERMINAL)).replace("@QUEUED", State.QUEUED.value)

# KEYS: exec, assigned, assigned changes. ARGV: request id, the placement's attempt, writer, changes maxlen.
# Refused (0) while exec holds another attempt: the stored placement is a later one's.
_UNASSIGN_LUA = """
local at = redis.call('HGET', KEYS[1], 'attempt')
if at and at ~= ARGV[2] then return 0 end
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'rid', ARGV[1], 'by', ARGV[3])
return 1
"""


class Assignments:
    """The placements this replica knows (by_request), and their records in Redis."""

    def __init__(self, client, names: Names, writer: str):
        self.r, self.names, self.writer = client, names, writer
        self._record = client.register_script(_RECORD_LUA)
        self._unassign = client.register_script(_UNASSIGN_LUA)
        self.by_request: dict[str, Assignment] = {}

    def record(self, a: Assignment, pipe) -> None:
        """Queue a placement's record on pipe (the caller executes it, then hands each reply to recorded())."""
        rid, n = a.scheduled.request_id, self.names
        p = n.partition(rid)
        self._record(
            keys=[
                n.layer(rid, "exec"),
                n.layer(rid, "meta"),
                n.assigned(p),
                n.assigned_changes(p),
                n.queue(p),
                n.queue_changes(p),
            ],
            args=[rid, a.scheduled.attempt, _enc.encode(a), self.writer, CHANGES_MAXLEN],
            client=pipe,
        )

    def recorded(self, a: Assignment, reply) -> bool:
        """Take in the record script's reply: the placement is known here only if it was recorded."""
        status = reply.decode() if isinstance(reply, bytes) else str(reply)
        if status == "recorded":
            self.by_request[a.scheduled.request_id] = a
            return True
        logger.info(
            "placement of %s at attempt %d not recorded: %s", a.scheduled.request_id, a.scheduled.attempt, status
        )
        return False

    def add(self, a: Assignment, client=None) -> bool:
        """Record one placement now (through client, else this replica's own)."""
        pipe = (client or self.r).pipeline(transaction=False)
        self.record(a, pipe)
        return self.recorded(a, pipe.execute()[0])

    def drop(self, placements: list[Scheduled]) -> None:
        """Forget placements (over, or moved back to the queue): from memory, and from Redis unless a later
        attempt has been placed since (its record is not this replica's to erase)."""
        if not placements:
            return
        pipe, n = self.r.pipeline(transaction=False), self.names
        for sch in placements:
            rid = sch.request_id
            if (mine := self.by_request.get(rid)) is not None and mine.scheduled.attempt <= sch.attempt:
                del self.by_request[rid]
            p = n.partition(rid)
            self._unassign(
                keys=[n.layer(rid, "exec"), n.assigned(p), n.assigned_changes(p)],
                args=[rid, sch.attempt, self.writer, CHANGES_MAXLEN],
                client=pipe,
            )
        pipe.execute()

    def of_worker(self, worker_id: str) -> list[Assignment]:
        return [a for a in self.by_request.values() if a.worker_id == worker_id]

    def settle_with_heartbeat(self, worker_id: str, held: tuple[str, ...], last_read_id: str) -> list[Assignment]:
        """Assignments the worker has read and no longer holds are over (finished, failed, cancelled): dropped,
        and returned."""
        read = entry_key(last_read_id) if last_read_id else (0, 0)
        held_set = set(held)
        over = [
            a
            for a in self.of_worker(worker_id)
            if entry_key(a.entry_id) <= read and a.scheduled.request_id not in held_set
        ]
        self.drop([a.scheduled for a in over])
        return over


def scheduled_event(q, worker_id: str, traceparent: str) -> Scheduled:
    """The placement of a queued request (a queue item, or its stored record: both carry the event, the attempt
    and the tokens so far) on a worker. The worker enforces the cap (the client's timeout, or the default one): an
    adaptive deadline bounds the wait in the queue, never a request its worker is making progress on."""
    ev = q.event
    return Scheduled(
        request_id=ev.request_id,
        worker_id=worker_id,
        reply_to=ev.reply_to,
        prompt_token_ids=ev.prompt_token_ids,
        output_token_ids=q.output_token_ids,
        sampling=ev.sampling,
        priority=ev.priority,
        deadline=ev.deadline,
        received_at=ev.received_at,
        attempt=q.attempt,
        traceparent=traceparent,
        group_id=ev.group_id,
        session=ev.session,
    )
