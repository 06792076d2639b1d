"""The scheduler's index of which worker holds which KV block, built from the workers' KV events.

Each worker announces its whole prefix cache when it starts (a KvEvents with cleared=True), then publishes
what each engine step changed (stored / removed hashes), numbered 1, 2, ... per incarnation. Applying them in
order reproduces the worker's cache; any event at or below the last applied number is a redelivery and is
dropped, so applying is idempotent.

Why this design and not a replay of the stream alone: the KV-event stream is capped (KV_EVENTS_MAXLEN), so
after a scheduler restart, or when a reader falls behind, the early events of a worker may be gone. A
reader finds that out from the numbers (a worker whose first visible event is not an announcement, or a gap)
and from the heartbeat, which carries the worker's latest (incarnation, seq): a heartbeat naming an event the
index has not seen, although the stream was read to its end after it, means that event was trimmed away.
Either way the worker's entries are dropped at once (stale entries would route requests to blocks that may
be gone) and the worker is asked, through its own stream, to announce its cache again (KvResyncRequested).
So the index is correct after a restart (replay what is left, re-ask for the rest) and after any trim.

A worker declared dead (the scheduler's liveness rule) is dropped with all its entries, and so is one the
scheduler has not heard from for a liveness TTL (routing.py: a restarted scheduler replays the events of
workers that died before it started). Memory is bounded by
the workers' pools: a worker holds at most total_blocks hashes, and every one it evicts is removed.
Pure: no Redis in here; the scheduler reads the stream and publishes the resync requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shared.wire.events import KvEvents, ResyncReason

logger = logging.getLogger(__name__)


@dataclass
class _Holder:
    incarnation: str
    seq: int  # last event applied
    blocks: set[bytes] = field(default_factory=set)


class KvIndex:
    def __init__(self) -> None:
        self.by_hash: dict[bytes, set[str]] = {}
        self.holders: dict[str, _Holder] = {}
        self.lagging: dict[str, ResyncReason] = {}  # worker -> why its entries are not known (until it announces them)

    def apply(self, ev: KvEvents) -> None:
        """Apply one worker's event in stream order (a redelivered one changes nothing)."""
        h = self.holders.get(ev.worker_id)
        if h is not None and h.incarnation == ev.incarnation and ev.seq <= h.seq:
            return  # applied already
        if ev.cleared:
            self.drop_worker(ev.worker_id)
            h = self.holders[ev.worker_id] = _Holder(ev.incarnation, ev.seq)
        elif h is None or h.incarnation != ev.incarnation:
            self._lose(ev.worker_id, ResyncReason.UNKNOWN_INCARNATION)
            return
        elif ev.seq != h.seq + 1:
            self._lose(ev.worker_id, ResyncReason.GAP, f"{h.seq}->{ev.seq}")
            return
        h.seq = ev.seq
        for b in ev.removed:
            if b in h.blocks:
                h.blocks.discard(b)
                self._unlink(b, ev.worker_id)
        for b in ev.stored:
            if b not in h.blocks:
                h.blocks.add(b)
                self.by_hash.setdefault(b, set()).add(ev.worker_id)

    def check_heartbeat(self, worker_id: str, incarnation: str, seq: int) -> None:
        """The worker says its latest event is (incarnation, seq); call once the stream was read to its end after
        that heartbeat: an event it names that the index has not applied was trimmed away."""
        if not incarnation or worker_id in self.lagging:
            return
        h = self.holders.get(worker_id)
        if h is None or h.incarnation != incarnation or h.seq < seq:
            self._lose(worker_id, ResyncReason.MISSED)

    def _lose(self, worker_id: str, why: ResyncReason, detail: str = "") -> None:
        if worker_id not in self.lagging:
            logger.warning(
                "KV index lost track of worker %s (%s%s): asking it to announce its cache",
                worker_id,
                why,
                f" {detail}" if detail else "",
            )
        self.drop_worker(worker_id)
        self.lagging[worker_id] = why

    def drop_worker(self, worker_id: str) -> None:
        """Forget every block of a worker (it died, or its cache is to be announced again)."""
        h = self.holders.pop(worker_id, None)
        self.lagging.pop(worker_id, None)
        if h is not None:
            for b in h.blocks:
                self._unlink(b, worker_id)

    def _unlink(self, block: bytes, worker_id: str) -> None:
        workers = self.by_hash.get(block)
        if workers is not None:
            workers.discard(worker_id)
            if not workers:
                del self.by_hash[block]

    def match(self, hashes: tuple[bytes, ...] | list[bytes]) -> dict[str, int]:
        """Worker -> how many leading blocks of `hashes` it holds (workers holding none are left out). One walk
        over the hashes, stopping at the first one nobody holds: O(blocks) set intersections, each over at most
        the workers still matching."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        depth = 0
        for b in hashes:
            holders = self.by_hash.get(b)
            nxt = (set(holders) if alive is None else alive & holders) if holders else set()
            for w in (alive or set()) - nxt:
                matched[w] = depth
            alive = nxt
            if not alive:
                break
            depth += 1
        for w in alive or ():
            matched[w] = depth
        return matched
