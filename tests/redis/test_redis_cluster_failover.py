"""The Redis clients on a Redis Cluster riding out a master's failover (shared/redis_io/redis_client.py): a write after the
master's SIGKILL lands once its replica is promoted, pipelines and scripts sent meanwhile run each command once, a
script is loaded again on a master that lost it, slots with no master left end in an error at the retry deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.exceptions import NoScriptError

import shared.redis_io.redis_client as rc
import shared.redis_io.redis_cluster_client
from shared.redis_io.redis_client import async_client, sync_client
from tests.support.redis_cluster import APPEND_LUA, cluster_settings


def _write_then_wait_for_replica(pipe, node, key: str):
    pipe.rpush(key, "before the kill")
    pipe.execute_command("WAIT", 1, 1000, target_nodes=node)  # on the same connection as the write


def _replicate_everything(r):
    """Wait until each master's replica has every write made so far: replication is one ordered stream per master,
    so a marker write acknowledged by WAIT carries all the writes before it (Redis acknowledges a write before its
    replica has it; a test that kills a master right after writing would otherwise race the replication)."""
    for node in r.get_primaries():
        tag = next(t for t in (f"{{w{i}}}" for i in range(100_000)) if r.get_node_from_key(t).name == node.name)
        pipe = r.pipeline(transaction=False)
        _write_then_wait_for_replica(pipe, node, f"{tag}marker")
        pipe.execute()


def test_sync_write_after_sigkill_of_the_keys_master_succeeds_once_its_replica_is_promoted(redis_cluster):
    r, key = sync_client(cluster_settings(redis_cluster)), "{f}events"
    pipe = r.pipeline(transaction=False)
    _write_then_wait_for_replica(pipe, r.get_node_from_key(key), key)
    assert pipe.execute() == [1, 1]  # one replica has the write
    old = redis_cluster.master_for_key(key)
    redis_cluster.kill(old)
    t0 = time.monotonic()
    assert r.rpush(key, "after the kill") == 2  # the same client object: retried until the promotion
    assert time.monotonic() - t0 < rc.CLUSTER_RETRY_S
    assert redis_cluster.master_for_key(key) in redis_cluster.replicas_of(old)
    assert r.lrange(key, 0, -1) == [b"before the kill", b"after the kill"]
    r.close()


def test_async_write_after_sigkill_of_the_keys_master_succeeds_once_its_replica_is_promoted(redis_cluster):
    key = "{f}events"
    old = redis_cluster.master_for_key(key)

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        pipe = a.pipeline(transaction=False)
        await a.initialize()
        _write_then_wait_for_replica(pipe, a.get_node_from_key(key), key)
        assert await pipe.execute() == [1, 1]
        redis_cluster.kill(old)
        t0 = time.monotonic()
        assert await a.rpush(key, "after the kill") == 2
        assert time.monotonic() - t0 < rc.CLUSTER_RETRY_S
        got = await a.lrange(key, 0, -1)
        await a.aclose()
        return got

    assert asyncio.run(run()) == [b"before the kill", b"after the kill"]
    assert redis_cluster.master_for_key(key) in redis_cluster.replicas_of(old)


def test_pipelines_and_scripts_sent_during_a_failover_run_each_command_once(redis_cluster):
    """A plain pipeline over every master and a MULTI/EXEC with a script on the dead master's slot, sent right
    after the kill: each command runs once (the healthy masters' part is not sent again), the script is loaded on
    the promoted replica (Redis 7 does not replicate SCRIPT LOAD)."""
    keys = [f"f{i}" for i in range(30)]
    r = sync_client(cluster_settings(redis_cluster))
    append = r.register_script(APPEND_LUA)
    append(keys=["{a}list"], args=["loaded"])  # loaded on every master, before the kill
    _replicate_everything(r)
    old = redis_cluster.master_for_key("{a}list")
    redis_cluster.kill(old)
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.incr(k)
    assert pipe.execute() == [1] * len(keys)
    with r.pipeline(transaction=True) as pipe:
        append(keys=["{a}list"], args=["sync"], client=pipe)
        pipe.incr("{a}n")
        assert pipe.execute() == [2, 1]
    _replicate_everything(r)  # the second kill below must not lose these increments

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        aappend = a.register_script(APPEND_LUA)
        tag = next(
            t
            for t in (f"{{b{i}}}" for i in range(1000))  # a master that still has a replica
            if redis_cluster.replicas_of(redis_cluster.master_for_key(t))
        )
        redis_cluster.kill(redis_cluster.master_for_key(tag))
        pipe = a.pipeline(transaction=False)
        for k in keys:
            pipe.incr(k)
        assert await pipe.execute() == [2] * len(keys)
        async with a.pipeline(transaction=True) as pipe:
            await aappend(keys=[f"{tag}list"], args=["async"], client=pipe)
            pipe.incr(f"{tag}n")
            assert await pipe.execute() == [1, 1]
        await a.aclose()

    asyncio.run(run())
    r.close()


def test_registered_script_in_a_pipeline_is_loaded_again_on_a_master_that_lost_it(redis_cluster):
    """A master restarted without failing over has no scripts: a plain pipeline loads the script and sends that
    command again; a MULTI/EXEC cannot (its other commands ran), so it raises, and the next one loads it first."""
    r = sync_client(cluster_settings(redis_cluster))
    append = r.register_script(APPEND_LUA)
    master = redis_cluster.master_for_key("{l}list")
    pipe = r.pipeline(transaction=False)
    append(keys=["{l}list"], args=["1"], client=pipe)
    assert pipe.execute() == [1]
    master.client.script_flush()
    pipe = r.pipeline(transaction=False)
    append(keys=["{l}list"], args=["2"], client=pipe)
    pipe.incr("other")
    assert pipe.execute() == [2, 1]
    master.client.script_flush()
    with r.pipeline(transaction=True) as pipe:
        append(keys=["{l}list"], args=["3"], client=pipe)
        with pytest.raises(NoScriptError):
            pipe.execute()
    with r.pipeline(transaction=True) as pipe:
        append(keys=["{l}list"], args=["4"], client=pipe)
        assert pipe.execute() == [3]

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        aappend = a.register_script(APPEND_LUA)
        master.client.script_flush()
        pipe = a.pipeline(transaction=False)
        await aappend(keys=["{l}list"], args=["5"], client=pipe)
        assert await pipe.execute() == [4]
        master.client.script_flush()
        pipe = a.pipeline(transaction=False)
        await aappend(keys=["{l}list"], args=["6"], client=pipe)
        assert await pipe.execute() == [5]
        await a.aclose()

    asyncio.run(run())
    r.close()


def test_command_on_slots_with_no_master_left_raises_after_the_retry_deadline(redis_cluster, monkeypatch):
    monkeypatch.setattr(shared.redis_io.redis_cluster_client, "CLUSTER_RETRY_S", 1.5)  # where the retries read it
    r = sync_client(cluster_settings(redis_cluster))
    r.set("{d}x", 1)
    master = redis_cluster.master_for_key("{d}x")
    for node in (master, *redis_cluster.replicas_of(master)):
        redis_cluster.kill(node)
    t0 = time.monotonic()
    with pytest.raises((redis.ConnectionError, redis.exceptions.ClusterError)):
        r.set("{d}x", 2)
    assert 1.0 < time.monotonic() - t0 < 1.5 + 1.0  # the deadline, give or take a pause and a refresh
    r.close()
