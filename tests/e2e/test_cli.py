"""`conveyor up`: a whole local cluster from one command, healing dead children, stopped cleanly by SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import psutil
import redis

from shared.redis_io.redis_server import free_port
from tests.support.cache import CACHE_DIR
from tests.support.cluster import KEY_A, auth
from tests.support.waiting import wait_for


@contextlib.contextmanager
def conveyor_up(tmp_path: Path, *args: str, env: dict | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`conveyor up` on a free port (env: more variables for it), returned once it printed its ready line; killed
    if still alive after."""
    port = free_port()
    env = {
        **os.environ,
        "CONVEYOR_CACHE_DIR": str(CACHE_DIR),
        "CONVEYOR_KV_CACHE_BYTES": str(128 << 20),
        "CONVEYOR_GEMM_TUNING": "false",  # as the clusters of the tests (tests/support/cluster.py says why)
        "CONVEYOR_WARMUP_BUDGET_S": "0",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=os.getcwd(),
    )
    try:
        line = proc.stdout.readline().decode()  # blocks until ready (or the launcher exits)
        url = f"http://127.0.0.1:{port}"
        assert url in line, (tmp_path / "up.log").read_text()[-3000:]
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def service_pid(launcher: subprocess.Popen, service: str) -> int | None:
    for child in psutil.Process(launcher.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.cmdline()[-2:] == ["services.cli", service] and child.status() != psutil.STATUS_ZOMBIE:
                return child.pid
    return None


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_conveyor_up_serves_then_stops_every_child_on_sigterm(tmp_path):
    with conveyor_up(tmp_path) as (proc, url):
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, tokenizer, scheduler, worker, gateway
        r = httpx.post(f"{url}/generate", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_for(lambda: not [c for c in children if _alive(c)], 10, what="every child gone")  # reaped meanwhile


def test_conveyor_up_restarts_a_killed_worker_and_tokenizer_and_serves_again(tmp_path):
    with conveyor_up(tmp_path, "--engine", "sim") as (proc, url):  # the launcher is the subject: no model to load
        killed = {name: service_pid(proc, name) for name in ("worker", "tokenizer")}
        assert all(killed.values()), killed
        for pid in killed.values():
            os.kill(pid, signal.SIGKILL)
        for name, old in killed.items():
            wait_for(lambda n=name, o=old: service_pid(proc, n) not in (None, o), 30, what=f"a new {name} process")
        r = httpx.post(f"{url}/generate", json={"prompt": "Hi", "max_tokens": 3, "timeout": 120}, timeout=180)
        assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1, r.text
        assert "restarting in" in (tmp_path / "up.log").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_conveyor_up_engine_sim_gives_simulated_engines_to_the_workers_only(tmp_path):
    with conveyor_up(tmp_path, "--engine", "sim", "--workers", "2") as (proc, url):
        r = httpx.post(f"{url}/generate", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 4
        children = psutil.Process(proc.pid).children()
        workers = [c for c in children if c.cmdline()[-2:] == ["services.cli", "worker"]]
        gateway = [c for c in children if c.cmdline()[-2:] == ["services.cli", "gateway"]]
        assert len(workers) == 2 and all(w.environ().get("CONVEYOR_ENGINE") == "sim" for w in workers)
        assert all("libtorch" not in Path(f"/proc/{w.pid}/maps").read_text() for w in workers)
        assert gateway[0].environ().get("CONVEYOR_ENGINE") is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_conveyor_up_connects_every_service_to_its_redis_on_a_unix_socket(tmp_path):
    with conveyor_up(tmp_path, "--engine", "sim") as (proc, url):
        r = httpx.post(f"{url}/generate", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        children = psutil.Process(proc.pid).children()
        services = [c for c in children if c.cmdline()[-2:-1] == ["services.cli"]]
        urls = {c.environ()["CONVEYOR_REDIS_URL"] for c in services}
        assert len(urls) == 1 and next(iter(urls)).startswith("unix://")
        sock = urlsplit(next(iter(urls))).path
        clients = redis.Redis(unix_socket_path=sock).client_list()
        assert len(clients) >= 5 and all(c["addr"].startswith(sock) for c in clients)  # none on the TCP port
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_conveyor_up_with_api_keys_gets_ready_and_serves_a_caller_with_a_key(tmp_path):
    # A ready timeout well past a simulated cluster's start: a launcher that never sees /ready stops everything then.
    up = conveyor_up(tmp_path, "--engine", "sim", "--ready-timeout", "60", env={"CONVEYOR_API_KEYS": KEY_A})
    with up as (proc, url):
        body = {"prompt": "Hi", "max_tokens": 3}
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 401  # the keys are in force
        r = httpx.post(f"{url}/generate", json=body, headers=auth(KEY_A), timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert KEY_A not in (tmp_path / "up.log").read_text()
