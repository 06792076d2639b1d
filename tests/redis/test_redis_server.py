"""The redis-server `conveyor up` starts: its services reach it on a Unix socket (a round trip without the TCP
stack: benchmarks/redis_socket.py), and its port stays open for tools."""

from __future__ import annotations

import stat

import pytest
import redis

from shared.redis_server import RedisServer

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
