"""The redis-server `conveyor up` starts: its services reach it on a Unix socket (a round trip without the TCP
stack: benchmarks/scale/redis_socket.py), and its port stays open for tools."""

from __future__ import annotations

import stat

import pytest
import redis

from shared.redis_io import redis_server
from shared.wire.errors import FatalError
from shared.redis_io.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "data", unix_socket=True).start()
    yield srv
    srv.stop()


def test_a_redis_server_with_a_unix_socket_is_reached_through_its_url(server):
    assert server.url.startswith("unix://")
    client = redis.Redis.from_url(server.url)
    client.set("k", "v")
    assert redis.Redis.from_url(server.tcp_url).get("k") == b"v"  # the same server on its port


def test_a_redis_servers_unix_socket_admits_only_its_own_user(server):
    assert stat.S_IMODE(server.socket.stat().st_mode) == 0o700


def test_a_redis_server_whose_socket_path_would_be_too_long_stays_on_tcp(tmp_path):
    srv = RedisServer(tmp_path / ("d" * 120), unix_socket=True)
    assert srv.socket is None
    assert srv.url == srv.tcp_url


def test_a_redis_server_without_a_unix_socket_is_reached_on_its_port(tmp_path):
    srv = RedisServer(tmp_path / "data").start()
    try:
        assert srv.url == srv.tcp_url
        assert redis.Redis.from_url(srv.url).ping()
        assert not (tmp_path / "data" / "redis.sock").exists()
    finally:
        srv.stop()


def test_a_redis_server_whose_port_another_server_holds_refuses_to_start_naming_the_port(server, tmp_path):
    """The other server answers the port's PING: it must not be taken for this one (its data, its lifetime)."""
    other = RedisServer(tmp_path / "other", port=server.port)
    with pytest.raises(FatalError, match=f"port {server.port}"):
        other.start()
    assert other.proc.poll() is not None  # its own process is not left behind


def test_a_redis_server_whose_free_port_was_taken_meanwhile_starts_on_another(server, tmp_path, monkeypatch):
    """Two processes can be handed one free port before either binds it (the test suite's parallel workers did)."""
    ports = iter([server.port])
    real_free_port = redis_server.free_port
    monkeypatch.setattr(redis_server, "free_port", lambda: next(ports, None) or real_free_port())
    srv = RedisServer(tmp_path / "second").start()
    try:
        assert srv.port != server.port
        assert redis.Redis(port=srv.port).info("server")["process_id"] == srv.proc.pid
    finally:
        srv.stop()
