"""The tests' own Redis Cluster (tests/support/redis_cluster.py) starts even when a port it found free is taken
before its node binds it: a race with the other test processes that made `make test` fail once (2026-12-03)."""

from __future__ import annotations

import socket

import pytest

from shared.wire.errors import FatalError
from tests.support import redis_cluster
from tests.support.redis_cluster import LocalRedisCluster

pytestmark = pytest.mark.redis


def test_a_local_cluster_whose_port_is_taken_before_its_node_binds_starts_its_node_on_another_port(
    tmp_path, monkeypatch
):
    try:
        LocalRedisCluster.binaries()
    except FatalError as e:
        pytest.skip(str(e))
    real = redis_cluster._free_port_pair
    held = real(set())  # a pair the cluster could use (its bus port in range too), then bound here
    holder = socket.socket()
    holder.bind(("127.0.0.1", held))
    holder.listen()
    calls = []

    def first_one_taken(taken: set[int]) -> int:
        calls.append(1)
        return held if len(calls) == 1 else real(taken)

    monkeypatch.setattr(redis_cluster, "_free_port_pair", first_one_taken)
    try:
        with LocalRedisCluster(tmp_path / "rc", masters=3, replicas=0) as rc:
            ports = [n.port for n in rc.nodes]
            assert held not in ports and len(ports) == 3
            assert all(n.client.ping() for n in rc.nodes)
    finally:
        holder.close()
