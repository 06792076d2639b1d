"""Start a local redis-server (7.0 or newer) from PATH."""

from __future__ import annotations

import ctypes
import signal
import sys
import logging
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from shared.wire.errors import FatalError

logger = logging.getLogger(__name__)


# The scheduler's replica sync reads XINFO STREAM's entries-added (Redis 7.0): an older server cannot run Conveyor.
MIN_REDIS = (7, 0)
INSTALL_HINT = "install Redis 7.0 or newer (Debian 12: apt-get install redis-server), or pass --redis-url"


def redis_version(binary: str) -> tuple[int, ...]:
    """The version a redis-server binary reports (`redis-server --version`: "Redis server v=7.0.15 sha=...")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    if not match:
        raise FatalError(f"{binary} --version printed no version ({out.strip()[:80]!r}): {INSTALL_HINT}")
    return tuple(int(x) for x in match.groups())


def find_redis_server() -> str:
    """redis-server from PATH, refused (FatalError, saying why) when it is older than MIN_REDIS."""
    found = shutil.which("redis-server")
    if not found:
        raise FatalError(f"no redis-server on PATH: {INSTALL_HINT}")
    version = redis_version(found)
    if version < MIN_REDIS:
        have, need = ".".join(map(str, version)), ".".join(map(str, MIN_REDIS))
        raise FatalError(f"{found} is Redis {have}; Conveyor needs {need} or newer: {INSTALL_HINT}")
    return found


def find_redis_cli() -> str:
    """redis-cli from PATH, else the one next to find_redis_server()'s binary."""
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


MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its terminating NUL)


class PortTaken(FatalError):
    """The port a redis-server was started on is another process's."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1; with unix_socket, also on a Unix socket in its data folder, and
    `url` names that socket. Why: a loopback TCP round trip goes through the TCP stack twice; on this project's 2-core
    VM a PING or a step's publish script took 0.95-1.16x as long on TCP as on the socket (benchmarks/scale/redis_socket.py,
    docs/benchmarks.md), and each hop of a request's way and each step's publish is one. The port stays open (tools,
    redis-cli)."""

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = False, unix_socket: bool = False):
        self.data_dir = Path(data_dir)
        self.port_given = port is not None
        self.port = port or free_port()
        self.appendonly = appendonly
        socket_path = self.data_dir.resolve() / "redis.sock"
        # a longer path than a socket's address holds: TCP alone
        self.socket = socket_path if unix_socket and len(str(socket_path).encode()) <= MAX_SOCKET_PATH else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What the services connect to: the Unix socket when there is one."""
        return f"unix://{self.socket}?db=0" if self.socket else self.tcp_url

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Started and answering on its port. A port chosen here may be handed to another process too before either
        binds it (free_port releases it): then the server is started again on another; a port given is refused."""
        for attempt in range(3):
            try:
                return self._start_once(timeout_s)
            except PortTaken as e:
                if self.port_given or attempt == 2:
                    raise
                logger.warning("%s: starting on another port", e)
                self.port = free_port()

    def _start_once(self, timeout_s: float) -> "RedisServer":
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
        if self.socket:  # only this user's processes may connect (0700), as the port is bound to 127.0.0.1
            cmd += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PortTaken(f"redis-server exited with {self.proc.returncode} (port {self.port} taken?)")
            try:
                # Whoever answers must be this process: another server on the port answers PING as well.
                if client.info("server")["process_id"] == self.proc.pid:
                    return self
                self.stop()
                raise PortTaken(f"port {self.port} is another redis-server's")
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
