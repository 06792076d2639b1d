"""The scheduler's internal objects: its queue and its view of the workers.

Built from events, never the events themselves: a QueuedRequest keeps the Preprocessed
event it came from only to re-emit its fields in `scheduled`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from services.scheduler.deadlines import Work
from shared.wire.bus import entry_key
from shared.wire.events import Heartbeat, Preprocessed


@dataclass(order=True)
class QueuedRequest:
    sort_key: tuple[int, float, int]  # (priority, received_at, tie-breaker): lower goes first
    request_id: str = field(compare=False)
    event: Preprocessed = field(compare=False)
    deadline: float = field(default=0.0, compare=False)  # epoch seconds; may be tighter than the event's cap
    attempt: int = field(default=1, compare=False)
    output_token_ids: tuple[int, ...] = field(default=(), compare=False)
    ahead: Work | None = field(default=None, compare=False)  # adaptive deadline: work queued ahead at arrival

    def work(self) -> Work:
        """Its own work on a worker: prompt (and resumed tokens) to prefill, tokens left to generate."""
        return Work(
            len(self.event.prompt_token_ids) + len(self.output_token_ids),
            self.event.sampling.max_tokens - len(self.output_token_ids),
        )


class RequestQueue:
    """A priority queue with removal by id (lazy deletion)."""

    def __init__(self) -> None:
        self._heap: list[QueuedRequest] = []
        self._live: dict[str, QueuedRequest] = {}
        self._tie = itertools.count()
        # The work of every live item, and the largest sort key ever pushed: an item pushed behind everything
        # (the usual arrival) has all of it ahead, found without a pass over the queue.
        self._prefill = self._decode = 0
        self._last_key: tuple | None = None

    def push(
        self,
        ev: Preprocessed,
        attempt: int = 1,
        output_token_ids: tuple[int, ...] = (),
        deadline: float | None = None,
        ahead: Work | None = None,
    ) -> QueuedRequest | None:
        if ev.request_id in self._live:
            return None
        item = QueuedRequest(
            (ev.priority, ev.received_at, next(self._tie)),
            ev.request_id,
            ev,
            ev.deadline if deadline is None else deadline,
            attempt,
            output_token_ids,
            ahead,
        )
        self._live[ev.request_id] = item
        heapq.heappush(self._heap, item)
        self._count(item, 1)
        if self._last_key is None or item.sort_key > self._last_key:
            self._last_key = item.sort_key
        return item

    def _count(self, item: QueuedRequest, sign: int) -> None:
        own = item.work()
        self._prefill += sign * own.prefill_tokens
        self._decode += sign * own.decode_tokens

    def remove(self, request_id: str) -> QueuedRequest | None:
        item = self._live.pop(request_id, None)  # its heap entry is skipped when reached
        if item is not None:
            self._count(item, -1)
        return item

    def peek(self) -> QueuedRequest | None:
        while self._heap and self._heap[0].request_id not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def pop(self) -> QueuedRequest:
        item = self.peek()
        assert item is not None
        heapq.heappop(self._heap)
        del self._live[item.request_id]
        self._count(item, -1)
        return item

    def expired(self, now: float) -> list[QueuedRequest]:
        return [q for q in self._live.values() if q.deadline <= now]

    def in_order(self) -> list[QueuedRequest]:
        """Every queued request, in the order it would be placed."""
        return sorted(self._live.values())

    def work_ahead(self) -> dict[str, Work]:
        """For every queued request, the work queued ahead of it (one pass in queue order)."""
        out, prefill, decode = {}, 0, 0
        for q in self.in_order():
            out[q.request_id] = Work(prefill, decode)
            own = q.work()
            prefill, decode = prefill + own.prefill_tokens, decode + own.decode_tokens
        return out

    def work_ahead_of(self, item: QueuedRequest) -> Work:
        """The work queued ahead of a live item. Called as it is pushed: an arrival behind everything queued
        (the usual case) is answered from the running totals, not a pass over the queue (which made a burst of
        N arrivals cost N^2 / 2)."""
        if item.sort_key == self._last_key:  # pushed behind everything ever queued: all that is live is ahead
            own = item.work()
            return Work(self._prefill - own.prefill_tokens, self._decode - own.decode_tokens)
        ahead = [q.work() for q in self._live.values() if q.sort_key < item.sort_key]
        return Work(sum(w.prefill_tokens for w in ahead), sum(w.decode_tokens for w in ahead))

    def count_ahead_of(self, item: QueuedRequest) -> int:
        """How many live items are queued ahead of it (all of them, for an arrival behind everything: no pass)."""
        if item.sort_key == self._last_key:
            return len(self._live) - 1
        return sum(1 for q in self._live.values() if q.sort_key < item.sort_key)

    def items(self) -> list[QueuedRequest]:
        return list(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live


@dataclass
class WorkerView:
    """What the scheduler knows of one worker: its last heartbeat plus what it sent since."""

    worker_id: str
    hb: Heartbeat | None  # None: known only from stored assignments (scheduler restarted), not heard from yet
    seen_at: float  # scheduler's monotonic time of the last heartbeat
    progress_at: float = field(default_factory=time.monotonic)  # last time its step counter moved (or it idled)
    inflight: dict[str, tuple[str, int]] = field(default_factory=dict)  # request -> (entry id, blocks needed)
    inflight_blocks: int = 0  # the sum of inflight's blocks, kept with it (placement asks for it every time)

    def observe(self, hb: Heartbeat) -> None:
        if self.hb is None or hb.step_no != self.hb.step_no or not hb.busy:
            self.progress_at = time.monotonic()
        self.hb, self.seen_at = hb, time.monotonic()
        read = entry_key(hb.last_read_id) if hb.last_read_id else (0, 0)
        # Entries the worker has read are counted in its own figures now.
        self.inflight = {r: v for r, v in self.inflight.items() if entry_key(v[0]) > read}
        self.inflight_blocks = sum(b for _, b in self.inflight.values())

    def add_inflight(self, request_id: str, entry_id: str, blocks: int) -> None:
        self.drop_inflight(request_id)
        self.inflight[request_id] = (entry_id, blocks)
        self.inflight_blocks += blocks

    def drop_inflight(self, request_id: str) -> None:
        if (old := self.inflight.pop(request_id, None)) is not None:
            self.inflight_blocks -= old[1]

    def clear_inflight(self) -> None:
        self.inflight.clear()
        self.inflight_blocks = 0

    def alive(self, ttl_s: float, hang_s: float) -> bool:
        """Heard from within ttl_s, and, if it holds work, stepped within hang_s."""
        now = time.monotonic()
        return now - self.seen_at <= ttl_s and now - self.progress_at <= hang_s

    def free_slots(self, slack: int) -> int:
        if self.hb is None or self.hb.draining:  # unheard of, or stopping
            return 0
        return self.hb.max_num_seqs + slack - self.hb.num_running - self.hb.num_waiting - len(self.inflight)

    def free_blocks(self) -> int:
        if self.hb is None:
            return 0
        return self.hb.free_blocks - self.inflight_blocks

    def score(self) -> float:
        """Higher is better: share of the KV pool still free after what is in flight."""
        return self.free_blocks() / max(1, self.hb.total_blocks if self.hb else 1)


def blocks_needed(prompt_len: int, block_size: int) -> int:
    return math.ceil((prompt_len + 1) / max(1, block_size))
