"""How scheduler replicas share the queue and the placements (docs/reliability.md, "Shared scheduler state").

Any replica may queue, requeue, place or drop a request: the QUEUED records and the placements (one hash each per
partition) are the truth, and a surviving or restarted replica adopts what a dead one held. Each write of those
hashes is followed, on the same pipeline or in the same script, by an entry on the hash's change stream naming the
request and its writer (recovery.note_change, assignments.py). A replica's periodic sync reads the entries after
its cursor, then only the records they name that another replica wrote: its cost follows what changed, where reading
every record (prompts included) every second cost O(queued prompt bytes) per replica (issue 24, item 2). A record
that changed under a known id (requeued by another replica at its next attempt, with its tokens so far) is read
again, where the whole read kept its stale copy.

Everything is read again, as at start, when the incremental view cannot be trusted: at start, when a change
stream was trimmed past entries this replica never read (more than CHANGES_MAXLEN changes of a partition between
two of its syncs, or a long pause), after a tick that failed half way (this replica's memory and Redis may
disagree), and after a dataset loss.
"""

from __future__ import annotations

import logging
import time

from services.scheduler.recovery import CHANGES_MAXLEN, decode_assignment, decode_queued
from services.scheduler.state import WorkerView
from shared.state.lifecycle import State
from shared.redis_io.replies import as_text

ON_A_WORKER = frozenset(s.value for s in (State.SCHEDULED, State.PREFILLING, State.DECODING, State.PREEMPTED))

logger = logging.getLogger(__name__)

# KEYS: a change stream. ARGV: the last entry id read, how many entries to read after it (0: only the figures).
# Returns entries-added, length and last id of the stream, and the entries, in one atomic step: whether entries
# after the cursor were trimmed unread follows from them (a plain XREAD cannot tell).
_READ_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, '0-0', {}} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local f = {}
for i = 1, #info, 2 do f[info[i]] = info[i + 1] end
if f['entries-added'] == nil then return redis.error_reply('Conveyor needs Redis 7.0 or newer (XINFO STREAM entries-added)') end
local got = {}
if ARGV[2] ~= '0' then got = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2]) end
return {f['entries-added'], f['length'], f['last-generated-id'], got}
"""


class Cursor:
    """Where this replica is in one change stream: the last entry read, and how many entries had been added to
    the stream up to it (so a gap shows: the stream's first kept entry is numbered entries-added - length + 1)."""

    def __init__(self, at: str = "0-0", seen: int = 0):
        self.at, self.seen = at, seen


class ReplicaSync:
    def __init__(self, svc, writer: str):
        self.svc, self.writer = svc, writer  # writer: how this process's own changes are named (skipped)
        self._read = svc.r.register_script(_READ_LUA)
        self.cursors: dict[str, Cursor] = {}
        self.full = True  # read everything at the next sync

    def streams(self) -> list[str]:
        n = self.svc.names
        return [*(n.queue_changes(p) for p in n.all_partitions), *(n.assigned_changes(p) for p in n.all_partitions)]

    def sync(self) -> None:
        if self.full or not self._incremental():
            self._everything()

    def _everything(self) -> None:
        """Read both hashes whole, and start each change stream's cursor where they were read."""
        svc, streams = self.svc, self.streams()
        pipe = svc.r.pipeline(transaction=False)
        for stream in streams:  # first: a change made while the hashes are read is read again after
            self._read(keys=[stream], args=["0-0", "0"], client=pipe)
        parts = svc.names.all_partitions
        for p in parts:
            pipe.hgetall(svc.names.assigned(p))
        for p in parts:
            pipe.hgetall(svc.names.queue(p))
        got = pipe.execute()
        figures, placed, queues = got[: len(streams)], got[len(streams) : -len(parts)], got[-len(parts) :]
        self.cursors = {s: Cursor(as_text(f[2]), int(f[0])) for s, f in zip(streams, figures)}
        svc.assignments.by_request = {as_text(k): decode_assignment(v) for part in placed for k, v in part.items()}
        for a in svc.assignments.by_request.values():
            svc.workers.setdefault(a.worker_id, WorkerView(a.worker_id, None, time.monotonic()))
        stored = {as_text(rid): payload for part in queues for rid, payload in part.items()}
        for rid in [q.request_id for q in svc.queue.items() if q.request_id not in stored]:
            svc.queue.remove(rid)  # placed or cancelled by another replica
        self._adopt(stored)
        self.full = False

    def _incremental(self) -> bool:
        """Read the change streams after the cursors, then what other replicas changed; False when a stream lost
        entries this replica never read (everything must be read again)."""
        queued, placed = set(), set()
        for _ in range(10):  # more than one read only after a burst of over CHANGES_MAXLEN changes
            more = False
            streams = self.streams()
            placements = set(streams[len(streams) // 2 :])  # the assigned hashes' change streams
            pipe = self.svc.r.pipeline(transaction=False)
            for stream in streams:
                cur = self.cursors.setdefault(stream, Cursor())
                self._read(keys=[stream], args=[cur.at, str(CHANGES_MAXLEN)], client=pipe)
            for stream, (added, length, _last, entries) in zip(streams, pipe.execute()):
                if not self._advance(stream, int(added), int(length), entries):
                    logger.warning(
                        "changes of %s were trimmed before this replica read them: reading everything", stream
                    )
                    return False
                ids = {as_text(f[b"rid"]) for _id, f in _fields(entries) if as_text(f[b"by"]) != self.writer}
                (placed if stream in placements else queued).update(ids)
                more = more or len(entries) == CHANGES_MAXLEN
            if not more:
                break
        self._apply(sorted(queued), sorted(placed))
        return True

    def _advance(self, stream: str, added: int, length: int, entries: list) -> bool:
        cur = self.cursors[stream]
        if added < cur.seen or added - length + 1 > cur.seen + 1:  # recreated, or trimmed past the cursor
            return False
        if entries:
            cur.at, cur.seen = as_text(entries[-1][0]), cur.seen + len(entries)
        return True

    def _apply(self, queued: list[str], placed: list[str]) -> None:
        """Read again the records other replicas changed: a placement as it is now (or gone); a queue record as
        it is now, with its request's state."""
        svc = self.svc
        pipe = svc.r.pipeline(transaction=False)
        for rid in placed:
            pipe.hget(svc.names.assigned(svc.names.partition(rid)), rid)
        for rid in queued:
            pipe.hget(svc.names.queue(svc.names.partition(rid)), rid)
        got = pipe.execute()
        for rid, raw in zip(placed, got[: len(placed)]):
            if raw is None:
                svc.assignments.by_request.pop(rid, None)
                continue
            a = svc.assignments.by_request[rid] = decode_assignment(raw)
            svc.workers.setdefault(a.worker_id, WorkerView(a.worker_id, None, time.monotonic()))
        stored = {}
        for rid, raw in zip(queued, got[len(placed) :]):
            if raw is None:
                svc.queue.remove(rid)  # placed, cancelled or timed out by another replica
            else:
                stored[rid] = raw
        self._adopt(stored)

    def _adopt(self, stored: dict[str, bytes]) -> None:
        """Queue the stored records this replica does not hold, or holds at another attempt, whose requests are
        QUEUED; drop the records of requests ended or expired meanwhile. The record of a request on a worker is
        left: it is dropped with the placement's record (assignments.py), or is what repair.py finishes a
        placement cut short from."""
        svc, recs = self.svc, {rid: decode_queued(raw) for rid, raw in stored.items()}
        held = {q.request_id: q.attempt for q in svc.queue.items()}
        todo = [rid for rid, rec in recs.items() if held.get(rid) != rec.attempt]
        pipe = svc.r.pipeline(transaction=False)
        for rid in todo:
            pipe.hget(svc.names.layer(rid, "meta"), "state")
        stale = []
        for rid, state in zip(todo, pipe.execute()):
            svc.queue.remove(rid)
            if state is not None and as_text(state) == State.QUEUED.value:
                svc.push_record(recs[rid])
            elif state is None or as_text(state) not in ON_A_WORKER:
                stale.append(rid)
        svc.records.drop(stale)


def _fields(entries: list):
    """(entry id, {field: value}) of a script's XRANGE reply (flat field lists)."""
    for entry_id, flat in entries:
        yield entry_id, {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
