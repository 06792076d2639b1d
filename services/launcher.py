"""`conveyor up`: Redis, then one tokenizer, scheduler, gateway and N workers as child processes.

Children that die are restarted (with a growing delay), so a local cluster heals itself.
SIGINT or SIGTERM stops every child (SIGTERM first, then SIGKILL after a grace period).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.process.backoff import backoff_s
from shared.text.model_files import resolve_model_dir
from shared.process.ready import wait_ok
from shared.redis_io.redis_server import RedisServer, die_with_parent
from shared.process.runtime import StopFlag, setup_logging
from shared.process.service_table import SERVICES
from shared.settings import CommonSettings, child_environment

logger = logging.getLogger(__name__)

STOP_GRACE_S = 35.0  # a worker drains held requests on SIGTERM
STABLE_S = 60.0  # a child that ran this long before it died was not crash-looping: its backoff starts over
READY_POLL_S = 0.5  # between polls of the gateway's /ready while the cluster starts


@dataclass
class Child:
    name: str
    env: dict
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = field(default=0.0)
    started_at: float = field(default=0.0)

    def start(self) -> None:
        # Children log to stderr: stdout carries only the launcher's one "ready" line.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", self.name.split("#")[0]],
            env=self.env,
            stdout=sys.stderr.fileno(),
            preexec_fn=die_with_parent,
        )
        self.started_at = time.monotonic()
        logger.info("started %s (pid %d)", self.name, self.proc.pid)


class Launcher:
    def __init__(self, args):
        self.args = args
        self.settings = CommonSettings()
        setup_logging(self.settings.log_level)
        self.redis: RedisServer | None = None
        self.children: list[Child] = []

    def run(self) -> int:
        stop = StopFlag()
        url = self.args.redis_url or self._start_redis()
        resolve_model_dir(self.settings.model, self.settings.cache_dir)  # convert once, before the children start
        # With the variables read at a start: each child would otherwise start itself again to get them.
        base = child_environment(CONVEYOR_REDIS_URL=url, **self.settings.start_environment())
        if getattr(self.args, "redis_cluster", False):
            base["CONVEYOR_REDIS_CLUSTER"] = "true"
        elif self.redis is not None:  # the Redis started here is a single one, whatever the environment says
            base["CONVEYOR_REDIS_CLUSTER"] = "false"
        for spec in SERVICES.values():  # in the table's start order
            env = dict(base)
            if spec.http:
                env.update(CONVEYOR_PORT=str(self.args.port), CONVEYOR_HOST=self.args.host)
            if spec.name == "worker" and getattr(self.args, "engine", None):
                env.update(CONVEYOR_ENGINE=self.args.engine)
            many = spec.name == "worker"
            for name in [f"worker#{i}" for i in range(self.args.workers)] if many else [spec.name]:
                self.children.append(Child(name, env))
                self.children[-1].start()
        try:
            if self._wait_ready(stop):
                gateway = f"http://{self.args.host}:{self.args.port}"
                sys.stdout.write(f"Conveyor is ready: {gateway} (Ctrl-C to stop)\n")
                sys.stdout.flush()
                self._supervise(stop)
        finally:
            self._stop_all()
        return 0

    def _start_redis(self) -> str:
        data = Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
        self.redis = RedisServer(data, appendonly=True, unix_socket=True).start()
        logger.info("redis-server on %s and %s (data in %s)", self.redis.url, self.redis.tcp_url, data)
        return self.redis.url

    def _wait_ready(self, stop: StopFlag) -> bool:
        url = f"http://{self.args.host}:{self.args.port}/ready"

        def check() -> bool | None:
            if stop.stopped:
                return False
            self._restart_dead()
            return None

        if wait_ok(url, self.args.ready_timeout, READY_POLL_S, check):
            return True
        if not stop.stopped:
            logger.error("the cluster was not ready within %.0f s", self.args.ready_timeout)
        return False

    def _supervise(self, stop: StopFlag) -> None:
        while not stop.stopped:
            self._restart_dead()
            time.sleep(0.5)

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                if now - c.started_at >= STABLE_S:
                    c.restarts = 0
                delay = backoff_s(c.restarts, 1.0, 30.0)
                logger.error("%s exited with %s; restarting in %.0f s", c.name, c.proc.returncode, delay)
                c.proc, c.restarts, c.next_start = None, c.restarts + 1, now + delay
            if c.proc is None and now >= c.next_start:
                c.start()

    def _stop_all(self) -> None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for c in self.children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if self.redis is not None:
            self.redis.stop()
