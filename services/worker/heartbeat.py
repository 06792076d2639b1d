"""The worker's heartbeat, sent by a thread so a long step never looks like a dead worker.

The step loop only updates a snapshot (its step counter included); the thread publishes the
latest one every interval. A dead or frozen process (SIGKILL, SIGSTOP) sends nothing and is
noticed after the liveness TTL; a live process whose loop is stuck keeps beating with the same
step counter while it has work, and the scheduler treats it as hung after its hang timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import redis

from shared.wire.bus import write_event
from shared.wire.constants import HEARTBEAT_MAXLEN, PRIVATE_STREAM_TTL_S
from shared.wire.events import Heartbeat
from shared.process.runtime import Liveness

from shared.state.sessions import SESSION_FIGURES

logger = logging.getLogger(__name__)


class Heartbeater:
    def __init__(self, client, live: Liveness):
        self.r = client
        self.names = live.names
        self.interval_s = live.interval_s
        self.live = live
        self._snapshot: Heartbeat | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def update(self, hb: Heartbeat) -> None:
        self._snapshot = hb  # one reference assignment: atomic under the GIL

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.live.clear(self.r)
        except redis.RedisError as e:
            logger.warning("could not clear the liveness entry: %s", e)

    def beat(self) -> None:
        hb = self._snapshot
        if hb is None:
            return
        hb = msgspec.structs.replace(hb, sent_at=time.time())
        pipe = self.r.pipeline(transaction=False)
        write_event(pipe, self.names, self.names.heartbeat_stream, hb, HEARTBEAT_MAXLEN)
        self.live.queue(pipe, _summary(hb))
        pipe.expire(self.names.worker_stream(hb.worker_id), PRIVATE_STREAM_TTL_S)  # lives while this worker does
        pipe.execute()
        self.live.written()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as e:
                logger.warning("heartbeat failed: %s", e)


def _summary(hb: Heartbeat) -> dict:
    """What the liveness entry shows besides at/ttl (read by /ready, /metrics and tests)."""
    return {
        "at": hb.sent_at,
        "running": hb.num_running,
        "waiting": hb.num_waiting,
        "held": len(hb.request_ids),
        "total_blocks": hb.total_blocks,
        "block_size": hb.block_size,
        "free_blocks": hb.free_blocks,
        "cached_blocks": hb.cached_blocks,
        "preemptions": hb.num_preemptions,
        "prefix_cache_queries": hb.prefix_cache_queries,
        "prefix_cache_hits": hb.prefix_cache_hits,
        "step": hb.step_no,
        "step_time_s": hb.step_time_s,
        "num_drafted": hb.num_drafted,
        "num_draft_accepted": hb.num_draft_accepted,
        **{k: getattr(hb, k) for k in SESSION_FIGURES},
    }
