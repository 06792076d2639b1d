"""What every service process does the same way: logging, its instance id, stop signals, liveness."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid

import redis

from shared.process import health_file, liveness
from shared.process.backoff import backoff_s
from shared.wire.constants import Names
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)


QUIET_LIBRARIES = ("httpx", "httpcore")  # a line per HTTP request at INFO: the launcher's /ready polls filled the log


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
    for name in QUIET_LIBRARIES:  # their warnings and errors still show
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


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
    """One process's entry in its service kind's liveness hash (shared.process.liveness); it stops counting as live
    when the process stops refreshing it. With a health folder, each write Redis accepted is also told to the
    container's healthcheck (shared.process.health_file): call written() after executing a pipeline queue() filled."""

    read = staticmethod(liveness.read_live)  # live instances of a service kind -> their entries (no SCAN)

    def __init__(self, names: Names, service: str, instance: str, interval_s: float, ttl_s: float, health_dir=""):
        self.names, self.service, self.instance = names, service, instance
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.health_dir = health_dir
        self._last = 0.0
        self._queued_at = 0.0  # wall time of the last write queued: the entry is live until then + ttl
        self._file_failing = False

    @classmethod
    def of(cls, settings: CommonSettings, service: str, instance: str) -> Liveness:
        """A process's entry as its settings say: interval, TTL, health folder."""
        s = settings
        return cls(s.names(), service, instance, s.heartbeat_interval_s, s.liveness_ttl_s, s.health_dir)

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def queue(self, pipe, info: dict | None = None) -> None:
        """Queue a refresh on a pipeline the caller executes (with its other writes), then calls written()."""
        self._last = time.monotonic()
        self._queued_at = time.time()
        liveness.queue_write(pipe, self.names, self.service, self.instance, self.ttl_s, info)

    def refresh(self, client, info: dict | None = None) -> None:
        pipe = client.pipeline(transaction=False)
        self.queue(pipe, info)
        pipe.execute()
        self.written()

    def written(self) -> None:
        """The queued write is in Redis: tell the health file. A disk that refuses is logged (once until it
        works again), never raised: the healthcheck failing is its consequence, not the service's."""
        if not self.health_dir:
            return
        try:
            health_file.write(self.health_dir, self.service, self._queued_at + self.ttl_s)
            self._file_failing = False
        except OSError as e:
            if not self._file_failing:
                logger.warning("%s: cannot write its health file in %s (%r)", self.instance, self.health_dir, e)
            self._file_failing = True

    def clear(self, client) -> None:
        liveness.remove(client, self.names, self.service, self.instance)
        if self.health_dir:
            try:
                health_file.remove(self.health_dir, self.service)
            except OSError as e:  # the file lapses by itself within a TTL
                logger.warning("%s: cannot remove its health file in %s (%r)", self.instance, self.health_dir, e)


class LivenessThread:
    """Refreshes one process's liveness entry from a thread of its own, every interval, with its own client: a
    process whose main loop is busy for seconds (a big answer, a long step) is not taken for a dead one.
    progressing() tells whether that loop still moves at all: a loop stuck for good must not be kept alive."""

    def __init__(self, client, live: Liveness, progressing, info: dict | None = None):
        self.r, self.live, self.progressing, self.info = client, live, progressing, info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{live.service}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.progressing():
                    self.live.refresh(self.r, self.info)
                else:
                    logger.error(
                        "%s: its main loop has not moved for long: no longer refreshing its liveness",
                        self.live.instance,
                    )
            except Exception as e:  # noqa: BLE001 - the thread outlives anything; Redis away is the usual case
                logger.warning("%s: liveness refresh failed (%r)", self.live.instance, e)
            self._stop.wait(self.live.interval_s)


def run_loop(stop: StopFlag, tick, name: str, on_nogroup=None) -> None:
    """Call tick() until stopped. The loop survives any Redis error: while Redis is away or refuses, back off
    (50 ms doubling to 2 s) and try again, so services ride out a Redis restart instead of dying with it. A
    NOGROUP error means Redis lost the stream (a restart without persistence, a flush): on_nogroup() creates
    the consumer groups again and the loop goes on at once."""
    failures = 0
    while not stop.stopped:
        try:
            tick()
            failures = 0
        except redis.ResponseError as e:
            if on_nogroup is not None and "NOGROUP" in str(e):
                logger.warning("%s: a consumer group is gone (%s); creating the groups again", name, e)
                _retry(on_nogroup, name)
                continue
            failures = _back_off(name, e, failures)
        except redis.RedisError as e:
            failures = _back_off(name, e, failures)


def _back_off(name: str, e: Exception, failures: int) -> int:
    failures += 1
    delay = backoff_s(failures)
    logger.warning("%s: redis unavailable (%r); retrying in %.2f s", name, e, delay)
    time.sleep(delay)
    return failures


def _retry(action, name: str) -> None:
    try:
        action()
    except redis.RedisError as e:  # the next tick fails the same way and comes back here
        logger.warning("%s: recovery step failed (%r)", name, e)
