"""The images the compose tests run: Conveyor's, built from the checkout, and the base images it needs.

No registry image can be pulled on the machines this project is built on, so when `python:3.11-slim` or
`redis:7.4` is not in the engine already, a stand-in is built from Debian's own packages: debootstrap a
bookworm rootfs, `docker import` it, and add Debian's python3 3.11 (a venv first on PATH, as the official
image has pip) or redis-server. Where the host's TLS goes through a re-signing proxy, the stand-in trusts the
host's CA bundle, or pip inside a build could not reach PyPI; a real python:3.11-slim needs nothing of that.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.docker.engine import STATE, Unavailable

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DEBIAN = "conveyor-local/debian:bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")

PYTHON_STANDIN = f"""FROM {DEBIAN}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \\
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /usr/local/python
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PATH=/usr/local/python/bin:$PATH SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
"""
REDIS_STANDIN = f"""FROM {DEBIAN}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis /data
WORKDIR /data
"""


def run(cmd: list[str], env: dict, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def has_image(env: dict, name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], env=env, capture_output=True).returncode == 0


def _debian(env: dict) -> None:
    if has_image(env, DEBIAN):
        return
    if not shutil.which("debootstrap"):
        raise Unavailable("no base image in the engine and no debootstrap to build one")
    rootfs = STATE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=ca-certificates",
            "bookworm",
            str(rootfs),
            "http://deb.debian.org/debian",
        ],
        env,
    )
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        shutil.rmtree(rootfs / junk, ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "-", DEBIAN], env, stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def _standin(env: dict, name: str, dockerfile: str) -> str:
    if not has_image(env, name):
        _debian(env)
        with tempfile.TemporaryDirectory() as ctx:
            (Path(ctx) / "Dockerfile").write_text(dockerfile)
            shutil.copy(HOST_CA, Path(ctx) / "ca-certificates.crt")
            run(["docker", "build", "--network", "host", "-t", name, ctx], env)
    return name


def base_images(env: dict) -> dict[str, str]:
    """name -> what to use for it: the official image if the engine has it, else a local stand-in."""
    out = {}
    for official, local, dockerfile in (
        ("python:3.11-slim", "conveyor-local/python:3.11", PYTHON_STANDIN),
        ("redis:7.4", "conveyor-local/redis:7", REDIS_STANDIN),
    ):
        out[official] = official if has_image(env, official) else _standin(env, local, dockerfile)
    return out


class _WheelServer:
    """The host's CPU torch wheel over HTTP on 127.0.0.1, as a --find-links page for the image's build (the
    build runs on the host network): pip picks 2.13.0+cpu over PyPI's CUDA 2.13.0 by its local version."""

    def __init__(self, folder: Path):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(folder)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the build's requests are not test output
        return None


def torch_pip_args(folder: Path) -> tuple[str, _WheelServer | None]:
    """The TORCH_PIP_ARGS build argument: the CPU index where it can be reached; here, the CPU wheel the
    host's pip resolves (its configured find-links / mirrors), served locally."""
    override = os.environ.get("CONVEYOR_DOCKER_TORCH_PIP_ARGS")
    if override is not None:
        return override, None
    run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), "torch==2.13.0"],
        dict(os.environ),
        timeout=900,
    )
    wheels = list(folder.glob("torch-*.whl"))
    if not wheels or "+cpu" not in wheels[0].name:
        return "--index-url https://download.pytorch.org/whl/cpu", None
    server = _WheelServer(folder)
    return f"--find-links {server.url}", server


def build_conveyor(env: dict, tag: str) -> float:
    """Build Conveyor's image from the checkout; returns the seconds it took."""
    bases = base_images(env)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as wheels:
        pip_args, server = torch_pip_args(Path(wheels))
        try:
            run(
                [
                    "docker",
                    "build",
                    "--network",
                    "host",
                    "-t",
                    tag,
                    "--build-arg",
                    f"BASE_IMAGE={bases['python:3.11-slim']}",
                    "--build-arg",
                    f"TORCH_PIP_ARGS={pip_args}",
                    str(ROOT),
                ],
                env,
                timeout=3600,
            )
        finally:
            if server:
                server.close()
    return time.monotonic() - started
