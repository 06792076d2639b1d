"""A pipeline that runs a registered script asks Redis whether it has the script once a connection, not before every
execute (redis-py's SCRIPT EXISTS: a round trip more per pipeline, seven on a request's way to its first token); and
a Redis that restarts without its scripts is given them again before a reconnected connection sends anything."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import NoScriptError

from shared.redis_io.redis_client import async_client, sync_client
from shared.settings import CommonSettings

INCR_LUA = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


def checks(server_client) -> int:
    """SCRIPT EXISTS calls the server has answered (INFO commandstats)."""
    return server_client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)


def run_pipelines(client, script, key: str, times: int, transaction: bool) -> list:
    out = []
    for _ in range(times):
        pipe = client.pipeline(transaction=transaction)
        script(keys=[key], args=[1], client=pipe)
        pipe.get(key)
        out.append(pipe.execute())
    return out


async def run_pipelines_async(client, script, key: str, times: int, transaction: bool) -> list:
    out = []
    for _ in range(times):
        pipe = client.pipeline(transaction=transaction)
        await script(keys=[key], args=[1], client=pipe)
        await pipe.get(key)
        out.append(await pipe.execute())
    return out


@pytest.fixture
def settings(redis_server):
    return CommonSettings(redis_url=redis_server.url)


@pytest.mark.parametrize("transaction", [False, True])
def test_a_pipeline_s_script_is_checked_once_per_connection(settings, redis_client, transaction):
    client = sync_client(settings)
    script = client.register_script(INCR_LUA)
    before = checks(redis_client)
    got = run_pipelines(client, script, "n", 5, transaction)
    assert [int(r[0]) for r in got] == [1, 2, 3, 4, 5]
    assert checks(redis_client) - before == 1


@pytest.mark.parametrize("transaction", [False, True])
def test_an_asyncio_pipeline_s_script_is_checked_once_per_connection(settings, redis_client, transaction):
    async def run():
        client = async_client(settings)
        try:
            return await run_pipelines_async(client, client.register_script(INCR_LUA), "n", 5, transaction)
        finally:
            await client.aclose()

    before = checks(redis_client)
    got = asyncio.run(run())
    assert [int(r[0]) for r in got] == [1, 2, 3, 4, 5]
    assert checks(redis_client) - before == 1


@pytest.mark.parametrize("transaction", [False, True])
def test_a_restarted_redis_gets_the_scripts_before_a_reconnected_pipeline_runs(settings, redis_server, transaction):
    client = sync_client(settings)
    script = client.register_script(INCR_LUA)
    run_pipelines(client, script, "n", 2, transaction)
    redis_server.stop()
    redis_server.start()  # same port, no persistence: no key, no script
    assert run_pipelines(client, script, "n", 2, transaction) == [[1, b"1"], [2, b"2"]]


@pytest.mark.parametrize("transaction", [False, True])
def test_a_restarted_redis_gets_the_scripts_before_a_reconnected_asyncio_pipeline_runs(
    settings, redis_server, transaction
):
    async def run():
        client = async_client(settings)
        try:
            script = client.register_script(INCR_LUA)
            await run_pipelines_async(client, script, "n", 2, transaction)
            redis_server.stop()
            redis_server.start()
            return await run_pipelines_async(client, script, "n", 2, transaction)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == [[1, b"1"], [2, b"2"]]


def test_a_script_flushed_under_a_live_connection_fails_one_pipeline_and_is_loaded_for_the_next(settings, redis_client):
    """SCRIPT FLUSH keeps the connections: the connection's memory is wrong once, the NOSCRIPT reply makes it
    forget, and the next pipeline checks again (a flush on a serving Redis is an operator's act, said in the
    module's docstring)."""
    client = sync_client(settings)
    script = client.register_script(INCR_LUA)
    run_pipelines(client, script, "n", 1, False)
    redis_client.script_flush()
    with pytest.raises(NoScriptError):
        run_pipelines(client, script, "n", 1, False)
    assert run_pipelines(client, script, "n", 1, False) == [[2, b"2"]]  # the failed one's INCRBY did not run


def test_scripts_run_directly_still_load_themselves(settings, redis_client):
    client = sync_client(settings)
    script = client.register_script(INCR_LUA)
    redis_client.script_flush()
    assert script(keys=["n"], args=[2]) == 2
    assert isinstance(client, redis.Redis)
