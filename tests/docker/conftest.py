"""Fixtures of the compose tests: a real Docker engine, Conveyor's image built from this checkout, and one
compose project started from the repository's own docker-compose.yml for the whole module.

Run with `make test-docker` (not part of `make test`: a first build and a first worker start take minutes).
What each phase took is printed at the end of the run and written to tests/artifacts/compose-timings.json.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.docker.engine import TIMINGS, Engine, Unavailable, compose_command
from tests.docker.images import ROOT, base_images, build_conveyor, run

logger = logging.getLogger(__name__)

IMAGE = "conveyor:compose-test"
READY_TIMEOUT_S = 1200  # a first start on a 2-core machine measures the GEMM plans (minutes)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.fspath).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.docker)
            item.add_marker(pytest.mark.timeout(READY_TIMEOUT_S + 1800))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "compose test timings (s)")
        for phase, s in TIMINGS.items():
            terminalreporter.write_line(f"{phase:<40} {s:8.1f}")
        out = ROOT / "tests" / "artifacts"
        out.mkdir(parents=True, exist_ok=True)
        (out / "compose-timings.json").write_text(json.dumps(TIMINGS, indent=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Compose:
    """One compose project of the repository's docker-compose.yml plus the test override."""

    def __init__(self, env: dict, base: list[str], redis_image: str):
        self.project = f"conveyortest{secrets.token_hex(3)}"
        self.api_key, self.admin_key = secrets.token_hex(12), secrets.token_hex(12)
        self.port, self.sink_port = _free_port(), _free_port()
        self.env = {
            **env,
            "COMPOSE_PROJECT_NAME": self.project,
            "CONVEYOR_IMAGE": IMAGE,
            "CONVEYOR_REDIS_IMAGE": redis_image,
            "CONVEYOR_REDIS_PASSWORD": secrets.token_hex(12),
            "CONVEYOR_API_KEYS": self.api_key,
            "CONVEYOR_ADMIN_API_KEYS": self.admin_key,
            "CONVEYOR_GATEWAY_PORT": str(self.port),
            "CONVEYOR_JAEGER_UI_PORT": str(self.sink_port),
            "CONVEYOR_OTLP_PORT": str(_free_port()),
        }
        self.cmd = [*base, "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "tests/docker/compose.test.yml")]
        self.url = f"http://127.0.0.1:{self.port}"

    def __call__(self, *args: str, timeout: float = 600) -> str:
        return run([*self.cmd, *args], self.env, timeout=timeout, cwd=ROOT).stdout

    def docker(self, *args: str, timeout: float = 120) -> str:
        return run(["docker", *args], self.env, timeout=timeout).stdout

    def containers(self, service: str | None = None, all_: bool = False) -> list[dict]:
        label = f"label=com.docker.compose.project={self.project}"
        ids = self.docker(
            "ps",
            *(["-a"] if all_ else []),
            "-q",
            "--filter",
            label,
            *(["--filter", f"label=com.docker.compose.service={service}"] if service else []),
        ).split()
        return json.loads(self.docker("inspect", *ids)) if ids else []

    def wait_healthy(self, expect: dict[str, int], timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every service has `expect[service]` running containers, healthy where it has a healthcheck."""
        deadline = time.monotonic() + timeout_s
        while True:
            cs = self.containers()
            ready = {s: 0 for s in expect}
            for c in cs:
                svc, st = c["Config"]["Labels"]["com.docker.compose.service"], c["State"]
                ready[svc] = ready.get(svc, 0) + (
                    st["Running"] and st.get("Health", {}).get("Status", "healthy") == "healthy"
                )
            if all(ready.get(s, 0) >= n for s, n in expect.items()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout_s} s: {ready}\n{self('logs', '--tail', '30')}")
            time.sleep(2)

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", service)

    def client(self, key: str | None = None, timeout: float = 300) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key or self.api_key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


@pytest.fixture(scope="session")
def docker():
    try:
        engine = Engine()
        compose = compose_command(engine.env)
    except Unavailable as e:
        pytest.skip(f"no container engine here: {e}")
    try:
        yield {"env": engine.env, "compose": compose}
    finally:
        engine.stop()  # the dockerd this run started, if any: nothing is left running


@pytest.fixture(scope="session")
def image(docker) -> str:
    started = time.monotonic()
    bases = base_images(docker["env"])
    TIMINGS["base images (local stand-ins if missing)"] = time.monotonic() - started
    TIMINGS["docker build of the checkout"] = build_conveyor(docker["env"], IMAGE)
    size = json.loads(run(["docker", "image", "inspect", IMAGE], docker["env"]).stdout)[0]["Size"]
    TIMINGS["image size (MB)"] = size / 1e6
    return bases["redis:7.4"]


@pytest.fixture(scope="module")
def cluster(docker, image):
    c = Compose(docker["env"], docker["compose"], image)
    started = time.monotonic()
    try:
        c("up", "-d", "--no-build")
        c.wait_healthy({"redis": 1, "gateway": 1, "tokenizer": 1, "scheduler": 1, "worker": 1, "jaeger": 1})
        TIMINGS["up -d to every service healthy"] = time.monotonic() - started
        yield c
    finally:
        if c.containers(all_=True):
            subprocess.run(
                [*c.cmd, "down", "-v", "--remove-orphans", "-t", "5"],
                env=c.env,
                cwd=ROOT,
                capture_output=True,
                timeout=300,
            )
