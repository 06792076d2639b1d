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
from shared.bus import entry_key
from shared.events import Heartbeat, Preprocessed


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
        return Work(len(self.event.prompt_token_ids) + len(self.output_token_ids),
                    self.event.sampling.max_tokens - len(self.output_token_ids))


class RequestQueue:
    """A priority queue with removal by id (lazy deletion)."""

    def __init__(self) -> None:
        self._heap: list[QueuedRequest] = []
        self._live: dict[str, QueuedRequest] = {}
        self._tie = itertools.count()

    def push(self, ev: Preprocessed, attempt: int = 1, output_token_ids: tuple[int, ...] = (),
             deadline: float | None = None, ahead: Work | None = None) -> QueuedRequest | None:
        if ev.request_id in self._live:
            return None
        item = QueuedRequest((ev.priority, ev.received_at, next(self._tie)), ev.request_id, ev,
                             ev.deadline if deadline is None else deadline, attempt, output_token_ids, ahead)
        self._live[ev.request_id] = item
        heapq.heappush(self._heap, item)
        return item

    def remove(self, request_id: str) -> QueuedRequest | None:
        return self._live.pop(request_id, None)  # its heap entry is skipped when reached

    def peek(self) -> QueuedRequest | None:
        while self._heap and self._heap[0].request_id not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def pop(self) -> QueuedRequest:
        item = self.peek()
        assert item is not None
        heapq.heappop(self._heap)
        del self._live[item.request_id]
        return item

    def expired(self, now: float) -> list[QueuedRequest]:
        return [q for q in self._live.values() if q.deadline <= now]

    def work_ahead(self) -> dict[str, Work]:
        """For every queued request, the work queued ahead of it (one pass in queue order)."""
        out, prefill, decode = {}, 0, 0
        for q in sorted(self._live.values()):
            out[q.request_id] = Work(prefill, decode)
            own = q.work()
            prefill, decode = prefill + own.prefill_tokens, decode + own.decode_tokens
        return out

    def ahead_of(self, item: QueuedRequest) -> list[QueuedRequest]:
        return [q for q in self._live.values() if q.sort_key < item.sort_key]

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

    def observe(self, hb: Heartbeat) -> None:
        if self.hb is None or hb.step_no != self.hb.step_no or not hb.busy:
            self.progress_at = time.monotonic()
        self.hb, self.seen_at = hb, time.monotonic()
        read = entry_key(hb.last_read_id) if hb.last_read_id else (0, 0)
        # Entries the worker has read are counted in its own figures now.
        self.inflight = {r: v for r, v in self.inflight.items() if entry_key(v[0]) > read}

    def alive(self, ttl_s: float, hang_s: float) -> bool:
        """Heard from within ttl_s, and, if it holds work, stepped within hang_s."""
        now = time.monotonic()
        return now - self.seen_at <= ttl_s and now - self.progress_at <= hang_s

    def free_slots(self, slack: int) -> int:
        if self.hb is None or self.hb.max_num_seqs == 0:  # unheard of, or draining
            return 0
        return self.hb.max_num_seqs + slack - self.hb.num_running - self.hb.num_waiting - len(self.inflight)

    def free_blocks(self) -> int:
        if self.hb is None:
            return 0
        return self.hb.free_blocks - sum(b for _, b in self.inflight.values())

    def score(self) -> float:
        """Higher is better: share of the KV pool still free after what is in flight."""
        return self.free_blocks() / max(1, self.hb.total_blocks if self.hb else 1)


def blocks_needed(prompt_len: int, block_size: int) -> int:
    return math.ceil((prompt_len + 1) / max(1, block_size))
