"""The Redis clients on a Redis Cluster (shared/redis_io/redis_client.py): found from one node, scripts and transactions on
one slot, what cannot span slots, bounded connections; plain clients otherwise (a master's failover:
test_redis_cluster_failover.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, WatchError

from shared.redis_io.redis_client import async_client, is_cluster, key_slot, sync_client
from shared.redis_io import scripts
from shared.settings import CommonSettings
from tests.support.redis_cluster import APPEND_LUA, cluster_settings

# KEYS[1] and KEYS[2] (one slot) both incremented; returns their sum
INCR2_LUA = "return redis.call('INCR', KEYS[1]) + redis.call('INCR', KEYS[2])"


def _key_per_master(cluster) -> dict:
    """One key on each master: {master node: key}."""
    found = {}
    for i in range(1000):
        found.setdefault(cluster.master_for_key(f"k{i}"), f"k{i}")
        if len(found) == len(cluster.nodes) // 2:
            return found
    raise AssertionError("keys did not cover every master")


def test_cluster_clients_built_from_one_nodes_url_reach_keys_on_every_master(redis_cluster):
    keys = list(_key_per_master(redis_cluster).values())
    r = sync_client(cluster_settings(redis_cluster))
    assert isinstance(r, redis.cluster.RedisCluster) and is_cluster(r)
    assert len(r.get_primaries()) == 3 and len(r.get_nodes()) == 6
    for k in keys:
        r.set(k, f"sync {k}")

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        assert isinstance(a, redis.asyncio.cluster.RedisCluster) and is_cluster(a)
        got = await asyncio.gather(*(a.get(k) for k in keys))
        await asyncio.gather(*(a.set(k, f"async {k}") for k in keys))
        await a.aclose()
        return got

    assert asyncio.run(run()) == [f"sync {k}".encode() for k in keys]
    assert [r.get(k) for k in keys] == [f"async {k}".encode() for k in keys]
    r.close()


def test_one_slot_lua_script_runs_on_both_cluster_clients_alone_and_in_pipelines(redis_cluster):
    """redis-py blocks EVALSHA in cluster pipelines; these clients' pipelines run registered scripts (loading them
    on the masters first), in a MULTI/EXEC as in a plain pipeline."""
    r = sync_client(cluster_settings(redis_cluster))
    append, incr2 = r.register_script(APPEND_LUA), r.register_script(INCR2_LUA)
    assert incr2(keys=["{s}a", "{s}b"]) == 2
    with r.pipeline(transaction=True) as pipe:
        append(keys=["{s}list"], args=["tx"], client=pipe)
        incr2(keys=["{s}a", "{s}b"], client=pipe)
        pipe.lrange("{s}list", 0, -1)
        assert pipe.execute() == [1, 4, [b"tx"]]
    pipe = r.pipeline(transaction=False)
    for i in range(6):  # on every master: keys of several slots
        append(keys=[f"list{i}"], args=["plain"], client=pipe)
        pipe.get(f"nothing{i}")
    assert pipe.execute() == [1, None] * 6

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        aappend, aincr2 = a.register_script(APPEND_LUA), a.register_script(INCR2_LUA)
        assert await aincr2(keys=["{s}a", "{s}b"]) == 6
        async with a.pipeline(transaction=True) as pipe:
            await aappend(keys=["{s}list"], args=["atx"], client=pipe)
            await aincr2(keys=["{s}a", "{s}b"], client=pipe)
            pipe.lrange("{s}list", 0, -1)
            assert await pipe.execute() == [2, 8, [b"tx", b"atx"]]
        pipe = a.pipeline(transaction=False)
        for i in range(6):
            await aappend(keys=[f"list{i}"], args=["aplain"], client=pipe)
            pipe.get(f"nothing{i}")
        assert await pipe.execute() == [2, None] * 6
        await a.aclose()

    asyncio.run(run())
    r.close()


def test_one_slot_watch_multi_exec_commits_or_raises_watch_error_on_both_cluster_clients(redis_cluster):
    r, other = sync_client(cluster_settings(redis_cluster)), sync_client(cluster_settings(redis_cluster))
    r.set("{t}n", 1)

    def bump(meddle: bool):
        with r.pipeline(transaction=True) as pipe:
            pipe.watch("{t}n")
            n = int(pipe.get("{t}n"))
            if meddle:
                other.set("{t}n", 100)
            pipe.multi()
            pipe.set("{t}n", n + 1)
            pipe.rpush("{t}log", n)
            return pipe.execute()

    assert bump(False) == [b"OK", 1]  # redis-py 8.1's sync cluster MULTI/EXEC skips the reply callbacks: not True
    with pytest.raises(WatchError):
        bump(True)
    assert r.get("{t}n") == b"100" and r.lrange("{t}log", 0, -1) == [b"1"]

    async def run():
        a, aother = async_client(cluster_settings(redis_cluster)), async_client(cluster_settings(redis_cluster))

        async def abump(meddle: bool):
            async with a.pipeline(transaction=True) as pipe:
                await pipe.watch("{t}n")
                n = int(await pipe.get("{t}n"))
                if meddle:
                    await aother.set("{t}n", 200)
                pipe.multi()
                pipe.set("{t}n", n + 1)
                pipe.rpush("{t}log", n)
                return await pipe.execute()

        assert await abump(False) == [True, 2]
        with pytest.raises(WatchError):
            await abump(True)
        assert await a.get("{t}n") == b"200"
        await a.aclose()
        await aother.aclose()

    asyncio.run(run())
    r.close()
    other.close()


def test_watched_transaction_whose_connection_drops_raises_instead_of_committing_unwatched(redis_cluster):
    """redis-py's own retry would send the MULTI/EXEC again on a new connection, where the WATCH no longer holds,
    and commit over the concurrent change: these clients raise the connection error for the caller to start over."""
    r, other = sync_client(cluster_settings(redis_cluster)), sync_client(cluster_settings(redis_cluster))
    master = redis_cluster.master_for_key("{w}x")
    r.set("{w}x", "original")
    with r.pipeline(transaction=True) as pipe:
        pipe.watch("{w}x")
        pipe.get("{w}x")
        other.set("{w}x", "changed")
        master.client.execute_command("CLIENT KILL TYPE normal")  # drops the WATCHing connection (and other's)
        pipe.multi()
        pipe.set("{w}x", "blind")
        with pytest.raises(redis.ConnectionError):
            pipe.execute()
    assert r.get("{w}x") == b"changed"

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        async with a.pipeline(transaction=True) as pipe:
            await pipe.watch("{w}x")
            await pipe.get("{w}x")
            other.set("{w}x", "changed again")
            master.client.execute_command("CLIENT KILL TYPE normal")
            pipe.multi()
            pipe.set("{w}x", "blind")
            with pytest.raises(redis.ConnectionError):
                await pipe.execute()
        assert await a.get("{w}x") == b"changed again"
        await a.aclose()

    asyncio.run(run())
    r.close()
    other.close()


def test_xreadgroup_of_streams_in_two_slots_is_refused_before_sending(redis_cluster):
    r = sync_client(cluster_settings(redis_cluster))
    assert key_slot("s1") != key_slot("s2") and key_slot("{g}s1") == key_slot("{g}s2") == r.keyslot("{g}s2")
    for s in ("s1", "s2", "{g}s1", "{g}s2"):
        r.xgroup_create(s, "g", id="0", mkstream=True)
    with pytest.raises(RedisClusterException, match="all keys must map to the same key slot"):
        r.xreadgroup("g", "c", {"s1": ">", "s2": ">"}, block=10)
    assert r.xreadgroup("g", "c", {"{g}s1": ">", "{g}s2": ">"}, block=10) == []

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        with pytest.raises(RedisClusterException, match="all keys must map to the same key slot"):
            await a.xreadgroup("g", "c", {"s1": ">", "s2": ">"}, block=10)
        await a.aclose()

    asyncio.run(run())
    assert not issubclass(RedisClusterException, redis.RedisError)  # `except RedisError` does not catch it
    r.close()


def _command_calls(cluster) -> int:
    """COMMAND calls (COMMAND GETKEYS included) served by all the cluster's nodes so far."""
    return sum(
        int(n.info("commandstats").get(s, {}).get("calls", 0))
        for n in cluster.nodes
        if n.alive
        for s in ("cmdstat_command", "cmdstat_command|getkeys")
    )


def test_stream_reads_and_scripts_are_routed_without_asking_a_node_for_their_keys(redis_cluster):
    """redis-py asks a node (COMMAND GETKEYS, a round trip) for the keys of XREAD and XREADGROUP before each one,
    and of a script in a plain pipeline; the cluster clients find them themselves: the bus's reads cost one round
    trip, not two, and a pipeline of scripts one per node, not one more per script."""
    r, streams = sync_client(cluster_settings(redis_cluster)), {"{x}a": ">", "{x}b": ">"}
    append = r.register_script(APPEND_LUA)
    for s in streams:
        r.xgroup_create(s, "g", id="0", mkstream=True)
    r.xadd("{x}b", {"f": "v"})
    before = _command_calls(redis_cluster)
    got = r.xreadgroup("g", "c", streams, count=5, block=5)
    assert [name for name, _ in got] == [b"{x}b"]
    pipe = r.pipeline(transaction=False)
    pipe.xreadgroup("g", "c", streams, count=5)
    pipe.xread({"{x}a": "0"}, count=1)
    append(keys=["{x}list"], args=["v"], client=pipe)
    assert pipe.execute() == [[], [], 1]
    assert _command_calls(redis_cluster) - before == 0

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        await a.initialize()  # asks COMMAND once, for the other commands' keys
        before_async = _command_calls(redis_cluster)
        assert await a.xreadgroup("g", "c", streams, count=5, block=5) == []
        assert await a.xread({"{x}b": "0"}, count=1) != []
        aappend = a.register_script(APPEND_LUA)
        apipe = a.pipeline(transaction=False)
        apipe.xreadgroup("g", "c", streams, count=5)
        await aappend(keys=["{x}list"], args=["w"], client=apipe)
        assert await apipe.execute() == [[], 2]
        await a.aclose()
        return before_async

    before_async = asyncio.run(run())
    assert _command_calls(redis_cluster) - before_async == 0
    r.close()


def test_plain_pipeline_spans_slots_on_every_master_on_both_cluster_clients(redis_cluster):
    keys = [f"p{i}" for i in range(30)]
    assert len({redis_cluster.master_for_key(k) for k in keys}) == 3
    r = sync_client(cluster_settings(redis_cluster))
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.incr(k)
    assert pipe.execute() == [1] * len(keys)

    async def run():
        a = async_client(cluster_settings(redis_cluster))
        pipe = a.pipeline(transaction=False)
        for k in keys:
            pipe.incr(k)
            pipe.get(k)
        assert await pipe.execute() == [x for _ in keys for x in (2, b"2")]
        await a.aclose()

    asyncio.run(run())
    r.close()


def test_async_cluster_client_under_a_burst_waits_its_turn_with_at_most_max_connections_per_node(redis_cluster):
    async def run():
        a = async_client(cluster_settings(redis_cluster), max_connections=2, pool_timeout_s=30)
        # 12 blocking pops of empty lists (0.1 s each) at once, on one node: redis-py alone raises
        # MaxConnectionsError at the third
        got = await asyncio.gather(*(a.blpop([f"{{b}}empty{i}"], timeout=0.1) for i in range(12)))
        busiest = max(len(node._connections) for node in a.get_nodes())
        await a.aclose()
        return got, busiest

    got, busiest = asyncio.run(run())
    assert got == [None] * 12 and busiest <= 2


def test_async_cluster_client_gives_up_waiting_for_a_turn_after_pool_timeout(redis_cluster):
    async def run():
        a = async_client(cluster_settings(redis_cluster), max_connections=1, pool_timeout_s=0.3)
        holder = asyncio.create_task(a.blpop(["{h}wake"], timeout=5))  # holds the only turn until woken
        while not a._turns.locked():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError, match="No connection available"):
            await a.get("{h}other")
        waited = time.monotonic() - t0
        redis_cluster.master_for_key("{h}wake").client.rpush("{h}wake", "up")
        assert tuple(await holder) == (b"{h}wake", b"up")
        assert await a.get("{h}other") is None  # the turn is free again
        await a.aclose()
        return waited

    assert 0.25 < asyncio.run(run()) < 2


def test_settings_without_redis_cluster_give_the_plain_clients():
    settings = CommonSettings(redis_url="redis://127.0.0.1:1/0")  # never connected to
    r = sync_client(settings)
    assert type(r) is scripts.Redis and isinstance(r, redis.Redis) and not is_cluster(r)
    a = async_client(settings, max_connections=3, pool_timeout_s=1)
    assert type(a) is scripts.AsyncRedis and isinstance(a, aioredis.Redis) and not is_cluster(a)
    assert isinstance(a.connection_pool, aioredis.BlockingConnectionPool) and a.connection_pool.max_connections == 3
    assert settings.partitions == 1 and CommonSettings(redis_cluster=True).partitions == 16
    assert CommonSettings(redis_cluster=True, redis_partitions=4).partitions == 4


def test_conveyor_up_redis_cluster_without_redis_url_is_an_argument_error(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["up", "--redis-cluster"])
    assert exit_.value.code == 2 and "--redis-cluster needs --redis-url" in capsys.readouterr().err
