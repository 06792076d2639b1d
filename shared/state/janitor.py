"""The context janitor: keeps the request indexes in step with the contexts' expiring keys and enforces the cap
on stored ended contexts (CONVEYOR_MAX_ENDED_CONTEXTS), oldest ended first.

Under sustained load both are bulk work: at 1,000 endings/s a cap reached means ~10,000 deletions every 10 s
sweep, and as many index entries to forget once their keys expire. Everything here is therefore done in
batches of ids, each batch a few pipelined round trips whatever its size (issue 24: one context at a time took
4P+2 round trips each, inside the scheduler's tick). JanitorLoop runs it on a thread of its own with its own
Redis client, so no sweep ever delays a placement, a deadline or a cancel.

Three paths, each looping over batches until it has nothing left, up to max_batches a sweep (a sweep that
stops there says so: `behind`, and the loop sweeps again at once, so no ending rate leaves it behind):
  expired  ended requests whose keys have expired (end + ttl): forgotten from the indexes
  ghosts   requests whose keys expired before they ended (every process that held them died, an event was
           lost): forgotten from the indexes, the waiting set and their key's waiting set, or they would count
           against the admission bounds for ever (a permanent 429)
  cap      the oldest ended requests beyond the cap: their keys deleted, and forgotten
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

from shared.wire.bus import Bus
from shared.wire.constants import Names
from shared.state.lifecycle import TERMINAL, State
from shared.redis_io.redis_client import sync_client
from shared.settings import SchedulerSettings
from shared.redis_io.replies import as_text

logger = logging.getLogger(__name__)

BATCH = 500  # ids per pipeline: a bigger one would hold Redis from token traffic for longer
# Batches per path and sweep: 100,000 ids, 10,000 endings/s at the default 10 s interval. The bound keeps one
# sweep from starving the others' paths; a sweep that reaches it is followed at once by another.
MAX_BATCHES = 200
ALIVE = tuple(s for s in State if s not in TERMINAL)  # the states of a request still in the pipeline


class ContextJanitor:
    def __init__(self, client, names: Names, ttl_s: int, cap: int, batch: int = BATCH, max_batches: int = MAX_BATCHES):
        self.r, self.names, self.ttl_s, self.cap = client, names, ttl_s, cap
        self.batch, self.max_batches = batch, max_batches
        self.behind = False  # the last sweep stopped at max_batches with work left
        parts = names.all_partitions
        self._ended = [(p, names.state_set(p, s.value)) for p in parts for s in TERMINAL]
        # Where a ghost may sit: a live state's set, or the waiting set (its score is the creation time).
        self._alive = [(p, z) for p in parts for z in (names.waiting(p), *(names.state_set(p, s.value) for s in ALIVE))]

    def sweep(self, now: float, batch: int | None = None) -> int:
        """One pass of the three paths; returns the requests forgotten (or deleted)."""
        b = batch or self.batch
        self.behind = False
        return self._expired(now, b) + self._ghosts(now, b) + self._over_cap(b)

    def _expired(self, now: float, b: int) -> int:
        """Ended requests whose keys expired at (end time + ttl): their index entries go."""
        todo, removed = list(self._ended), 0
        for _ in range(self.max_batches):
            if not todo:
                return removed
            pipe = self.r.pipeline(transaction=False)
            for _p, zset in todo:
                pipe.zrangebyscore(zset, "-inf", now - self.ttl_s, start=0, num=b)
            found = list(zip(todo, pipe.execute()))
            removed += self._forget([(p, z, as_text(rid)) for (p, z), ids in found for rid in ids])
            todo = [pz for pz, ids in found if len(ids) == b]  # full: there may be more
        self.behind = self.behind or bool(todo)
        return removed

    def _ghosts(self, now: float, b: int) -> int:
        """Requests that never ended and whose keys are gone. A live request's keys last at least the ended
        contexts' TTL from its creation (the gateway gives them its request timeout more), so only entries older
        than that are candidates, and a candidate is a ghost only once its meta is gone: those still alive are
        stepped over (skip), not read again."""
        todo, removed = {pz: 0 for pz in self._alive}, 0
        for _ in range(self.max_batches):
            if not todo:
                return removed
            pipe = self.r.pipeline(transaction=False)
            for (_p, zset), skip in todo.items():
                pipe.zrangebyscore(zset, "-inf", now - self.ttl_s, start=skip, num=b)
            found = [(pz, [as_text(rid) for rid in ids]) for pz, ids in zip(todo, pipe.execute())]
            pipe = self.r.pipeline(transaction=False)
            for _pz, ids in found:
                for rid in ids:
                    pipe.exists(self.names.layer(rid, "meta"))
            alive = iter(pipe.execute())
            ghosts, nxt = {}, {}  # by id: one ghost is often found in two sets (waiting, and its state's)
            for (p, zset), ids in found:
                flags = [bool(next(alive)) for _ in ids]
                ghosts.update({rid: (p, zset, rid) for rid, kept in zip(ids, flags) if not kept})
                if len(ids) == b:
                    nxt[(p, zset)] = todo[(p, zset)] + sum(flags)
            removed += self._forget(list(ghosts.values()), ghost=True)
            todo = nxt
        self.behind = self.behind or bool(todo)
        return removed

    def _over_cap(self, b: int) -> int:
        """Delete the oldest ended contexts beyond the cap, merging the terminal sets by end time. Each set's
        head is read a batch at a time and kept until used, so a batch costs a read of the sets it emptied, the
        owners' lookup and the deletions: three round trips."""
        excess = sum(self._cards()[0]) - self.cap
        heads: list[list] = [[] for _ in self._ended]  # each set's next oldest (score, id), the oldest last
        full = [False] * len(self._ended)  # its last read was a whole batch: it may hold more
        removed = 0
        for _ in range(self.max_batches):
            if excess <= 0:
                return removed
            k, empty = min(b, excess), [i for i, h in enumerate(heads) if not h]
            # The sizes again with each read: another replica's janitor may be deleting too.
            cards, got = self._cards([(i, k) for i in empty])
            for i, ids in zip(empty, got):
                heads[i], full[i] = [(score, as_text(rid)) for rid, score in reversed(ids)], len(ids) == k
            excess = sum(cards) - self.cap
            take = _oldest(heads, full, min(b, excess))
            if not take:
                return removed
            removed += self._forget([(*self._ended[i], rid) for i, rid in take], delete=True)
            excess -= len(take)
        self.behind = self.behind or excess > 0
        return removed

    def _cards(self, reads: list[tuple[int, int]] = ()) -> tuple[list[int], list[list]]:
        """The terminal sets' sizes, and the heads (set index, how many) asked for, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for _p, zset in self._ended:
            pipe.zcard(zset)
        for i, n in reads:
            pipe.zrange(self._ended[i][1], 0, n - 1, withscores=True)
        got = pipe.execute()
        return got[: len(self._ended)], got[len(self._ended) :]

    def _forget(self, items: list[tuple[int, str, str]], delete: bool = False, ghost: bool = False) -> int:
        """Drop requests (partition, the set they were found in, id) from the indexes, in two round trips: the
        owners' lookup, then every removal. delete: their keys too (the cap). ghost: from every live state's set,
        the waiting sets and the owners' waiting sets (it was found in one of them; which others hold it is not
        known)."""
        if not items:
            return 0
        by_p: dict[int, list[str]] = {}
        for p, _z, rid in items:
            by_p.setdefault(p, []).append(rid)
        # The owner comes from the reverse lookup written at creation: a forgotten request's meta is gone.
        pipe = self.r.pipeline(transaction=False)
        for p, rids in by_p.items():
            pipe.hmget(self.names.request_owners(p), rids)
        owners = {
            rid: as_text(o) for (_p, rids), got in zip(by_p.items(), pipe.execute()) for rid, o in zip(rids, got) if o
        }
        members = self._members(items, owners, ghost)
        pipe = self.r.pipeline(transaction=False)
        if delete:
            for _p, _z, rid in items:
                pipe.delete(*self.names.request_keys(rid))
        for zset, ids in members.items():
            pipe.zrem(zset, *ids)
        for p, rids in by_p.items():
            pipe.hdel(self.names.request_owners(p), *rids)
        pipe.execute()
        return len(items)

    def _members(self, items, owners: dict[str, str], ghost: bool) -> dict[str, list[str]]:
        """Sorted set -> the members to remove from it (one ZREM each)."""
        out: dict[str, list[str]] = {}
        for p, zset, rid in items:
            sets = [z for q, z in self._alive if q == p] if ghost else [zset]
            for z in (*sets, self.names.requests_index(p)):
                out.setdefault(z, []).append(rid)
            if owner := owners.get(rid):
                out.setdefault(self.names.owner_index(p, owner), []).append(rid)
                if ghost:
                    out.setdefault(self.names.owner_waiting(p), []).append(f"{owner}\0{rid}")
        return out


def _oldest(heads: list[list], full: list[bool], n: int) -> list[tuple[int, str]]:
    """Up to n (set index, id), oldest first across the sets' heads. Stops where a set that may hold more runs out
    of read ids: its next ones may be older than the other heads."""
    heap = [(h[-1][0], i) for i, h in enumerate(heads) if h]
    heapq.heapify(heap)
    out: list[tuple[int, str]] = []
    while heap and len(out) < n:
        _score, i = heapq.heappop(heap)
        out.append((i, heads[i].pop()[1]))
        if heads[i]:
            heapq.heappush(heap, (heads[i][-1][0], i))
        elif full[i]:
            break
    return out


class JanitorLoop:
    """Sweeps every interval_s on a thread of its own (the janitor's client is its own too), then runs `chores`
    (the scheduler's stream trimming): off the scheduler's tick, a sweep of any size delays no placement. A
    sweep that fell behind is followed by the next at once. The loop survives any exception: logged, and tried
    again an interval later."""

    def __init__(self, janitor: ContextJanitor, interval_s: float, chores: Sequence[Callable[[], None]] = ()):
        self.janitor, self.interval_s, self.chores = janitor, interval_s, list(chores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="context-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = 0.0  # at once: a restarted scheduler catches up before its first interval
        while not self._stop.wait(delay):
            delay = self.interval_s
            try:
                t0 = time.monotonic()
                removed = self.janitor.sweep(time.time())
                for chore in self.chores:
                    chore()
            except redis.RedisError as e:  # Redis away or failing over: the next interval tries again
                logger.warning("context janitor: %r; sweeping again in %.1f s", e, delay)
                continue
            except Exception:  # a bug must not end the sweeps for good: the cap would never be enforced again
                logger.exception("context janitor: sweep failed; sweeping again in %.1f s", delay)
                continue
            if self.janitor.behind:
                delay = 0.0
            if removed:
                logger.info(
                    "context janitor: %d contexts forgotten in %.2f s%s",
                    removed,
                    time.monotonic() - t0,
                    " (more left: sweeping again)" if self.janitor.behind else "",
                )


def scheduler_janitor(
    settings: SchedulerSettings,
    names: Names,
    consumer: str,
    streams: list[str],
    chores: Sequence[Callable[[], None]] = (),
) -> JanitorLoop:
    """The scheduler's janitor, on a Redis client of its own: sweeps the contexts, then trims the shared streams'
    entries every consumer group is done with, then runs the scheduler's own chores (each with a client of its
    own: the placement repair)."""
    client = sync_client(settings)
    trimmer = Bus(client, names, consumer, settings.read_block_ms, settings.claim_idle_ms, settings.max_deliveries)

    def trim() -> None:
        for stream in streams:
            trimmer.trim_consumed(stream)

    janitor = ContextJanitor(client, names, settings.context_ttl_s, settings.max_ended_contexts)
    return JanitorLoop(janitor, settings.janitor_interval_s, [trim, *chores])
