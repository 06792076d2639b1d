"""`conveyor health SERVICE`, the containers' healthcheck: exit 0 only while this host's own process is live."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import redis

from shared import liveness
from shared.constants import Names
from shared.redis_server import free_port

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))


def probe(service: str, url: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "CONVEYOR_REDIS_URL": url, "CONVEYOR_NAMESPACE": "healthtest", **env}
    return subprocess.run([CONVEYOR, "health", service], env=full, capture_output=True, text=True, timeout=60)


def _live(server, instance: str, password: str | None = None) -> None:
    r = redis.Redis.from_url(server.url, password=password)
    liveness.write(r, Names("healthtest", 1, False), instance.split("-")[0], instance, ttl_s=30)


def test_a_worker_with_a_fresh_entry_of_this_host_is_healthy(redis_server):
    _live(redis_server, f"worker-{socket.gethostname()}-1-abc")
    done = probe("worker", redis_server.url)
    assert done.returncode == 0, done.stdout


def test_a_worker_whose_only_live_entries_are_other_hosts_is_unhealthy(redis_server):
    _live(redis_server, "worker-elsewhere-1-abc")
    done = probe("worker", redis_server.url)
    assert done.returncode == 1 and "1 live elsewhere" in done.stdout


def test_a_tokenizer_with_no_entry_at_all_is_unhealthy(redis_server):
    assert probe("tokenizer", redis_server.url).returncode == 1


def test_the_probe_authenticates_with_the_password_setting(redis_server):
    redis.Redis.from_url(redis_server.url).config_set("requirepass", "s3cret")
    _live(redis_server, f"scheduler-{socket.gethostname()}-1-abc", password="s3cret")
    assert probe("scheduler", redis_server.url).returncode == 1  # NOAUTH without it
    assert probe("scheduler", redis_server.url, CONVEYOR_REDIS_PASSWORD="s3cret").returncode == 0


def test_the_gateway_probe_fails_when_nothing_answers_on_its_port(redis_server):
    done = probe("gateway", redis_server.url, CONVEYOR_PORT=str(free_port()))
    assert done.returncode == 1 and "/health" in done.stdout
