"""A real Docker engine for the compose tests: the one the environment points at, else a dockerd of our own.

Our own daemon keeps all its state under one folder and changes nothing on the host: no iptables rules
(`--iptables=false`), no docker0 (`--bridge=none`), no forwarding. Compose's own network still resolves
service names (Docker's embedded DNS lives in each container's namespace) and publishes ports through
docker-proxy; containers get no route out, which the cluster never needs. Builds use `--network host`, the
only way they reach the package mirrors without NAT.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STATE = Path(os.environ.get("CONVEYOR_DOCKER_STATE", "/tmp/conveyor-docker"))
APT_PACKAGES = ("docker.io", "docker-compose", "debootstrap")
TIMINGS: dict[str, float] = {}  # phase -> seconds, printed at the end of the run (conftest's terminal summary)


class Unavailable(Exception):
    """No container engine can be had here: the tests skip with this reason."""


def _works(env: dict) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _apt_install(packages: tuple[str, ...]) -> None:
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable(f"{' '.join(missing)} not installed and apt-get cannot install them here")
    logger.info("installing %s", " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing, "iptables"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")


class Engine:
    """The Docker engine the tests use: `env` for every docker / compose command (DOCKER_HOST set), and `stop()`,
    which ends the dockerd this run started (none when the environment already had an engine)."""

    def __init__(self):
        self.env, self.daemon = dict(os.environ), None
        if shutil.which("docker") and _works(self.env):
            return
        _apt_install(APT_PACKAGES)
        self.env["DOCKER_HOST"] = f"unix://{STATE}/docker.sock"
        if not _works(self.env):
            self.daemon = _start_dockerd(self.env)

    def stop(self) -> None:
        if self.daemon is None:
            return
        self.daemon.terminate()
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        _clear_runtime_state()


def _clear_runtime_state() -> None:
    """What a stopped (or killed) dockerd leaves under its exec root: a network-namespace bind mount and sockets.
    Runtime state only (images and layers live in the data root, kept for the next run's build cache)."""
    netns = STATE / "exec" / "netns" / "default"
    if netns.exists():
        subprocess.run(["umount", str(netns)], capture_output=True)
    shutil.rmtree(STATE / "exec", ignore_errors=True)
    (STATE / "dockerd.pid").unlink(missing_ok=True)


def _start_dockerd(env: dict) -> subprocess.Popen:
    if not shutil.which("dockerd"):
        raise Unavailable("docker.io is installed but has no dockerd")
    STATE.mkdir(parents=True, exist_ok=True)
    _clear_runtime_state()  # an earlier run's daemon may have been killed with the session that ran it
    log = open(STATE / "dockerd.log", "ab")  # noqa: SIM115 - handed to the daemon, which outlives this call
    daemon = subprocess.Popen(
        [
            "dockerd",
            "--data-root",
            str(STATE / "data"),
            "--exec-root",
            str(STATE / "exec"),
            "--pidfile",
            str(STATE / "dockerd.pid"),
            "-H",
            env["DOCKER_HOST"],
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--bridge=none",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not _works(env):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise Unavailable(f"dockerd did not answer within 60 s; see {STATE / 'dockerd.log'}")
        time.sleep(0.5)
    logger.info("started dockerd with its state in %s", STATE)
    return daemon


def compose_command(env: dict) -> list[str]:
    """`docker compose` (v2) where the CLI has it, else docker-compose (v1, Debian's 1.29)."""
    if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Unavailable("neither `docker compose` nor docker-compose is installed")
