"""What every service process does the same way: logging, its instance id, stop signals, liveness."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid

import msgspec
import redis

from shared.constants import Names
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")


def instance_id(settings: CommonSettings, service: str) -> str:
    """A consumer name unique across hosts and restarts (a restarted process must not inherit pending entries
    by name: they are claimed by idle time instead)."""
    if settings.instance_id:
        return settings.instance_id
    return f"{service}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StopFlag:
    """Set by SIGTERM or SIGINT; main loops check it between iterations."""

    def __init__(self) -> None:
        self.stopped = False
        self.signal: int | None = None
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, signum, _frame) -> None:
        self.stopped = True
        self.signal = signum


class Liveness:
    """A key with a TTL per process; it disappears when the process stops refreshing it."""

    def __init__(self, names: Names, service: str, instance: str, interval_s: float, ttl_s: float):
        self.key = names.live(service, instance)
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self._last = 0.0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def refresh(self, client, info: dict | None = None) -> None:
        self._last = time.monotonic()
        client.set(self.key, msgspec.json.encode(info or {"at": time.time()}), px=self.ttl_ms)

    def clear(self, client) -> None:
        client.delete(self.key)


def run_loop(stop: StopFlag, tick, name: str) -> None:
    """Call tick() until stopped. While Redis is away, back off (50 ms doubling to 2 s) and try again:
    services ride out a Redis restart instead of dying with it."""
    failures = 0
    while not stop.stopped:
        try:
            tick()
            failures = 0
        except (redis.ConnectionError, redis.TimeoutError) as e:
            failures += 1
            delay = min(2.0, 0.05 * 2 ** min(failures, 6))
            logger.warning("%s: redis unavailable (%s); retrying in %.2f s", name, e, delay)
            time.sleep(delay)
