"""The gateway's background loops survive any Redis error, and /ready tells when one is not running."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from services.gateway.session.core import GatewayCore, cancel_until_done
from services.gateway.edge.errors import Unavailable
from services.gateway.session.handle import RequestHandle
from shared.wire.constants import EVENT_FIELD, GROUP_GATEWAY
from shared.wire.events import TokenDelta, TokenGenerated, encode
from shared.process.liveness import read_live
from shared.redis_io.redis_client import async_client
from shared.settings import GatewaySettings
from services.gateway.session.tracing import start_trace
from shared.wire.events import Sampling
from tests.support.inproc import calls, gateway_core, mark_live, small, started
from tests.support.factories import completed


async def _wait(check, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


def test_reply_reader_outlives_the_loss_of_its_group_and_makes_it_again(redis_server, redis_client, names):
    async def run():
        async with started(gateway_core(redis_server.url, names)) as core:
            await core.r.delete(core.reply_to)  # Redis lost the stream and its group
            await _wait(lambda: _has_group(core))
            assert not core.stalled_loops()

    asyncio.run(run())


async def _has_group(core) -> bool:
    try:
        return len(await core.r.xinfo_groups(core.reply_to)) == 1
    except redis.ResponseError:  # no such key yet
        return False


def test_ready_answers_503_while_the_reply_reader_is_not_running(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        async with started(gateway_core(redis_server.url, names)) as core:
            assert await core.ready() == {"tokenizer": 1, "scheduler": 1, "worker": 1}
            reader = next(t for t in core._tasks if t.get_name() == "replies")
            assert not await cancel_until_done([reader], 10)
            with pytest.raises(Unavailable, match="replies"):
                await core.ready()

    asyncio.run(run())


def _held_pool_core(redis_server, names):
    """A core whose request pool (two connections) is entirely held, as a burst of requests holds it."""
    s = GatewaySettings(
        redis_url=redis_server.url, namespace=names.ns, heartbeat_interval_s=0.1, redis_pool_timeout_s=30
    )
    return GatewayCore(s, async_client(s, 2, s.redis_pool_timeout_s), None, "test-model")


def test_liveness_is_refreshed_while_requests_hold_every_pooled_connection(redis_server, redis_client, names):
    async def run():
        core = _held_pool_core(redis_server, names)
        await core.start()
        held = [await core.r.connection_pool.get_connection() for _ in range(2)]
        since = time.time()
        try:
            await _wait(lambda: _refreshed_since(redis_client, names, core.id, since), timeout=5)
        finally:
            for c in held:
                await core.r.connection_pool.release(c)
            await core.stop()

    asyncio.run(run())


async def _refreshed_since(client, names, gateway_id: str, since: float) -> bool:
    entry = read_live(client, names, "gateway").get(gateway_id)
    return entry is not None and entry["at"] > since


def test_replies_reach_their_requests_while_requests_hold_every_pooled_connection(redis_server, redis_client, names):
    async def run():
        core = _held_pool_core(redis_server, names)
        await core.start()
        handle = RequestHandle("r1", core.reply_to, None, time.time() + 60, time.perf_counter())
        core.handles["r1"] = handle
        held = [await core.r.connection_pool.get_connection() for _ in range(2)]
        try:
            ev = TokenGenerated(worker_id="w", step=1, items=(TokenDelta("r1", 0, (42,)),))
            redis_client.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})
            async with asyncio.timeout(5):
                assert await handle.queue.get() == TokenDelta("r1", 0, (42,))
        finally:
            for c in held:
                await core.r.connection_pool.release(c)
            await core.stop()

    asyncio.run(run())


def test_reply_reader_reads_with_one_command_a_read_and_nothing_left_pending(redis_server, redis_client, names):
    """At one stream every token is one read: no acknowledgement or trim round trip after each (NOACK; the
    heartbeat trims), and the group's pending list stays empty."""

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        handle = RequestHandle("r1", core.reply_to, None, time.time() + 60, time.perf_counter())
        core.handles["r1"] = handle
        try:
            redis_client.config_resetstat()
            for i in range(20):
                ev = TokenGenerated(worker_id="w", step=i, items=(TokenDelta("r1", i, (42,)),))
                redis_client.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})
                async with asyncio.timeout(5):
                    assert await handle.queue.get() == TokenDelta("r1", i, (42,))
            assert calls(redis_client, "xack") == 0
            assert calls(redis_client, "xtrim") < 5  # the heartbeat's, not one a read
            assert redis_client.xpending(core.reply_to, GROUP_GATEWAY)["pending"] == 0
        finally:
            await core.stop()

    asyncio.run(run())


def test_reply_stream_is_trimmed_to_what_was_read_within_a_heartbeat(redis_server, redis_client, names):
    async def run():
        async with started(gateway_core(redis_server.url, names, heartbeat_interval_s=0.1)) as core:
            ev = TokenGenerated(worker_id="w", step=1, items=(TokenDelta("gone", 0, (42,)),))
            pipe = redis_client.pipeline(transaction=False)
            for _ in range(250):
                pipe.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})
            last = pipe.execute()[-1]
            await _wait(lambda: _read_up_to(core, last))
            await _wait(lambda: _shorter(redis_client, core.reply_to, 150))  # whole nodes of 100 entries go

    asyncio.run(run())


async def _read_up_to(core, entry_id) -> bool:
    return core.replies_read_id == entry_id


async def _shorter(client, stream: str, n: int) -> bool:
    return client.xlen(stream) < n


def test_reply_reader_outlives_a_failure_while_it_repairs_its_lost_group(redis_server, redis_client, names):
    """Redis lost the reply group and is still failing when the reader makes it again: the repair's own error
    must not end the reader (/ready would 503 for ever while /health says 200)."""

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        real, failures = core._ensure_group, [redis.ConnectionError("Redis is restarting")]

        async def flaky():
            if failures:
                raise failures.pop()
            await real()

        core._ensure_group = flaky
        try:
            await core.r.delete(core.reply_to)
            await _wait(lambda: _has_group(core))
            assert not failures and not core.stalled_loops()
        finally:
            await core.stop()

    asyncio.run(run())


def test_reply_reader_outlives_an_unexpected_error_and_routes_later_replies(redis_server, redis_client, names):
    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        real, failures = core._route, [RuntimeError("a bug in routing one entry")]

        def flaky(fields, entry_id=""):
            if failures:
                raise failures.pop()
            real(fields, entry_id)

        core._route = flaky
        handle = RequestHandle("r1", core.reply_to, None, time.time() + 60, time.perf_counter())
        core.handles["r1"] = handle
        try:
            ev = TokenGenerated(worker_id="w", step=1, items=(TokenDelta("r1", 0, (42,)),))
            redis_client.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})  # the one that breaks
            await _wait(lambda: _no(failures))
            redis_client.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})  # the next is routed
            async with asyncio.timeout(5):
                assert await handle.queue.get() == TokenDelta("r1", 0, (42,))
            assert not core.stalled_loops()
        finally:
            await core.stop()

    asyncio.run(run())


async def _no(items: list) -> bool:
    return not items


def test_liveness_refresh_outlives_an_unexpected_error(redis_server, redis_client, names):
    async def run():
        core = gateway_core(redis_server.url, names, heartbeat_interval_s=0.1)
        real, failures = core.epoch.acheck, [RuntimeError("unexpected")]

        async def flaky(client):
            if failures:
                raise failures.pop()
            return await real(client)

        await core.start()
        core.epoch.acheck = flaky
        try:
            await _wait(lambda: _no(failures))
            since = time.time()
            await _wait(lambda: _refreshed_since(redis_client, names, core.id, since), timeout=5)
            assert not core.stalled_loops()
        finally:
            await core.stop()

    asyncio.run(run())


def test_a_finished_generation_is_answered_when_redis_fails_after_its_end(redis_server, names, model_dir):
    """The end event arrived; reading the history for the metrics and writing the output layer are bookkeeping:
    Redis failing then must not turn the finished answer into a 500 (or a stream without its end)."""
    from transformers import AutoTokenizer

    from services.gateway.session.drive import final_body
    from services.gateway.text.stop_strings import TextStream

    async def run():
        core = gateway_core(redis_server.url, names, socket_timeout_s=1.0)
        h = RequestHandle(
            "r1",
            core.reply_to,
            TextStream(AutoTokenizer.from_pretrained(model_dir), []),
            time.time() + 60,
            time.perf_counter(),
        )
        h.trace = start_trace("r1", small(), Sampling(max_tokens=2), "test-model", "/generate", "", h.t0)
        h.deliver(TokenDelta("r1", 0, (42, 43)))
        h.deliver(completed("r1", "length", prompt_tokens=3, output_tokens=2, worker_id="w1"))
        while h.ended is None:
            await h.next_chunk(5)
        redis_server.stop()  # Redis goes away right after the ending
        try:
            return await final_body(core, h)
        finally:
            await core.r.aclose()

    body = asyncio.run(run())
    assert body["finish_reason"] == "length" and body["token_ids"] == [42, 43]
    assert body["metrics"]["output_tokens"] == 2


def test_a_stalled_event_loop_does_not_let_the_gateways_liveness_go_stale(redis_server, redis_client, names):
    """Client-controlled work can hold the event loop for seconds (issue 24, item 9); the scheduler must not
    take that for a dead gateway and cancel every request it serves."""
    ttl = 2.0
    seen: list[bool] = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            seen.append("gw-stall" in read_live(redis_client, names, "gateway"))
            time.sleep(0.1)

    async def run():
        core = gateway_core(
            redis_server.url, names, instance_id="gw-stall", liveness_ttl_s=ttl, heartbeat_interval_s=0.3
        )
        await core.start()
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,))
        try:
            await _wait(lambda: _live(redis_client, names, "gw-stall"))
            watcher.start()
            time.sleep(2 * ttl + 1)  # the loop is held: no coroutine runs meanwhile
        finally:
            stop.set()
            watcher.join()
            await core.stop()

    asyncio.run(run())
    assert seen and all(seen), f"stale for {seen.count(False)} of {len(seen)} samples"


async def _live(client, names, instance: str) -> bool:
    return instance in read_live(client, names, "gateway")
