"""The worker's KV events: what its prefix cache stored and evicted, published for the scheduler's index.

One KvEvents per engine step that changed the cache (never one per block), numbered 1, 2, ... within this
process's incarnation. The first is a full announcement (cleared=True, every cached hash), sent at start and
again whenever a scheduler asks (KvResyncRequested: its index lost track, e.g. the capped stream was trimmed
before it read them) or a publish failed midway (the scheduler may or may not have the event: announcing the
whole cache again makes either case right). On a clean stop the worker announces an empty cache.
"""

from __future__ import annotations

import logging
import uuid

import redis

from services.worker.engine import Engine
from shared.wire.bus import Bus
from shared.wire.constants import KV_EVENTS_MAXLEN
from shared.wire.events import KvEvents

logger = logging.getLogger(__name__)


class KvEventPublisher:
    def __init__(self, bus: Bus, worker_id: str, engine: Engine, block_size: int):
        self.bus, self.worker_id, self.engine, self.block_size = bus, worker_id, engine, block_size
        self.incarnation = uuid.uuid4().hex[:12]
        self.seq = 0  # number of the last event published
        self._announce = True  # the next publish is a full announcement

    def start(self) -> None:
        """Track the cache from now on (blocks cached before, e.g. by a warm-up, are in the first announcement)."""
        self.engine.enable_kv_events()
        self.announce()

    def announce(self) -> None:
        """Publish the whole cache (what changed since the last event is part of it)."""
        self._announce = True
        self.publish_changes()

    def publish_changes(self) -> None:
        stored, removed = self.engine.take_kv_events()
        if self._announce:
            self._publish(cleared=True, stored=self.engine.cached_block_hashes(), removed=[])
        elif stored or removed:
            self._publish(cleared=False, stored=stored, removed=removed)

    def clear(self) -> None:
        """A clean stop: the cache goes with the process."""
        self.engine.take_kv_events()
        try:
            self._publish(cleared=True, stored=[], removed=[])
        except redis.RedisError as e:  # the scheduler drops this worker's entries once it is declared dead
            logger.warning("could not announce the cleared KV cache: %s", e)

    def _publish(self, cleared: bool, stored: list[bytes], removed: list[bytes]) -> None:
        self.seq += 1  # used up even if the write fails: a retry must not look like a redelivery of this one
        ev = KvEvents(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            seq=self.seq,
            block_size=self.block_size,
            cleared=cleared,
            stored=tuple(stored),
            removed=tuple(removed),
        )
        try:
            self.bus.publish(self.bus.names.kv_events_stream, ev, maxlen=KV_EVENTS_MAXLEN)
        except redis.RedisError:
            # Whether it was written is unknown, and these changes are taken: the next event announces it all.
            self._announce = True
            raise
        self._announce = False
