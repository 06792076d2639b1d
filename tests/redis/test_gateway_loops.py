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
from shared.constants import EVENT_FIELD, GROUP_GATEWAY
from services.gateway.session import reconcile
from shared.context_store import ContextStore
from shared.events import Completed, TokenDelta, TokenGenerated, encode
from shared.lifecycle import Lifecycle, Owner, State
from tests.support.factories import request_received
from shared.liveness import read_live
from shared.redis_client import async_client
from shared.settings import GatewaySettings
from services.gateway.session.tracing import start_trace
from shared.events import Sampling
from tests.support.inproc import calls, gateway_core, mark_live, small


async def _wait(check, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


def test_reply_reader_outlives_the_loss_of_its_group_and_makes_it_again(redis_server, redis_client, names):
    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        try:
            await core.r.delete(core.reply_to)  # Redis lost the stream and its group
            await _wait(lambda: _has_group(core))
            assert not core.stalled_loops()
        finally:
            await core.stop()

    asyncio.run(run())


async def _has_group(core) -> bool:
    try:
        return len(await core.r.xinfo_groups(core.reply_to)) == 1
    except redis.ResponseError:  # no such key yet
        return False


def test_ready_answers_503_while_the_reply_reader_is_not_running(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        try:
            assert await core.ready() == {"tokenizer": 1, "scheduler": 1, "worker": 1}
            reader = next(t for t in core._tasks if t.get_name() == "replies")
            assert not await cancel_until_done([reader], 10)
            with pytest.raises(Unavailable, match="replies"):
                await core.ready()
        finally:
            await core.stop()

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
        core = gateway_core(redis_server.url, names, heartbeat_interval_s=0.1)
        await core.start()
        try:
            ev = TokenGenerated(worker_id="w", step=1, items=(TokenDelta("gone", 0, (42,)),))
            pipe = redis_client.pipeline(transaction=False)
            for _ in range(250):
                pipe.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})
            last = pipe.execute()[-1]
            await _wait(lambda: _read_up_to(core, last))
            await _wait(lambda: _shorter(redis_client, core.reply_to, 150))  # whole nodes of 100 entries go
        finally:
            await core.stop()

    asyncio.run(run())


async def _read_up_to(core, entry_id) -> bool:
    return core.replies_read_id == entry_id


async def _shorter(client, stream: str, n: int) -> bool:
    return client.xlen(stream) < n


def _finished(redis_client, names) -> str:
    """A request created as the gateway does and driven to FINISHED as the pipeline does (its output written)."""
    ev = request_received()
    store = ContextStore(redis_client, names, 60)
    keys, argv = store.create_args(ev.request_id, {"priority": 0}, {"prompt": ev.prompt}, ev)
    assert store._create(keys=keys, args=argv)[0] == b"ok"
    lc = Lifecycle(redis_client, names, "worker", 60)
    for to in (State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.DECODING):
        assert lc.transition(ev.request_id, to, owner=Owner("w1", 1) if to == State.SCHEDULED else None).applied
    store.update(redis_client, ev.request_id, "output", {"output_tokens": 0, "finish_reason": "length"})
    assert lc.transition(ev.request_id, State.FINISHED, "length").applied
    return ev.request_id


def _silent_handle(core, rid: str, created: bool = True) -> RequestHandle:
    h = RequestHandle(rid, core.reply_to, None, time.time() + 60, time.perf_counter())
    if created:
        h.created()
    h.last_event_at -= 60  # its last event a minute ago
    core.handles[rid] = h
    return h


def test_an_ending_still_unread_in_the_reply_stream_is_not_rebuilt_from_the_context(redis_server, redis_client, names):
    """The silent-request repair (a Redis Cluster's) must not mistake a reply reader that lags behind its stream
    (1,000 streams on a busy gateway) for a lost ending: silence counts only what the reader has read."""

    async def run():
        core = gateway_core(redis_server.url, names)  # not started: its reader has read nothing yet
        rid = _finished(redis_client, names)
        h = _silent_handle(core, rid)
        redis_client.xadd(
            core.reply_to,
            {
                EVENT_FIELD: encode(
                    Completed(
                        request_id=rid,
                        worker_id="w1",
                        finish_reason="length",
                        prompt_tokens=1,
                        output_tokens=0,
                        cached_tokens=0,
                        num_preemptions=0,
                    )
                )
            },
        )
        await reconcile.repair_silent(core)
        assert h.queue.empty() and not h.filling
        await core.r.aclose()

    asyncio.run(run())


def test_a_request_still_being_created_is_not_failed_as_state_lost(redis_server, names):
    """Under a burst an admission can wait for a Redis connection longer than SILENT_S after its handle was
    registered (the handle comes first: the first reply may come back at once). Its context does not exist yet:
    that is not a lost state (the benchmark's 1,000 streams on a cluster got four such 503s)."""

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        try:
            h = _silent_handle(core, "r-being-created", created=False)
            async with asyncio.timeout(10):
                while core.replies_read_to - h.last_event_at <= reconcile.SILENT_S + 1:
                    await asyncio.sleep(0.05)  # the reader has read past the point where it counts as silent
            await reconcile.repair_silent(core)
            assert h.queue.empty()
        finally:
            await core.stop()

    asyncio.run(run())


def test_a_silent_request_settled_without_its_ending_gets_it_built_from_the_context(redis_server, redis_client, names):
    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()  # its reader reads the (empty) reply stream: it is not behind
        try:
            h = _silent_handle(core, _finished(redis_client, names))
            async with asyncio.timeout(10):
                while h.queue.empty():
                    await reconcile.repair_silent(core)
                    await asyncio.sleep(0.1)
            end = h.queue.get_nowait()
            assert isinstance(end, Completed) and end.finish_reason == "length"
        finally:
            await core.stop()

    asyncio.run(run())


def test_tokens_after_a_gap_wait_for_the_missing_ones_read_from_the_tokens_list(redis_server, redis_client, names):
    """A delta whose tokens before it never came (on a Redis Cluster, a worker that died between its transaction
    and its reply events) is held; the missing tokens are read from the request's list, then it goes on."""

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        handle = RequestHandle("r1", core.reply_to, None, time.time() + 60, time.perf_counter())
        core.handles["r1"] = handle
        redis_client.rpush(names.tokens("r1"), 40, 41, 42, 43)
        try:
            for delta in (TokenDelta("r1", 0, (40,)), TokenDelta("r1", 3, (43,))):  # 41 and 42 never sent
                ev = TokenGenerated(worker_id="w", step=1, items=(delta,))
                redis_client.xadd(core.reply_to, {EVENT_FIELD: encode(ev)})
            got = []
            async with asyncio.timeout(10):
                while len(got) < 4:
                    delta = await handle.queue.get()
                    got += list(delta.token_ids)
            assert got == [40, 41, 42, 43]
        finally:
            await core.stop()

    asyncio.run(run())


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
        h.deliver(
            Completed(
                request_id="r1",
                worker_id="w1",
                finish_reason="length",
                prompt_tokens=3,
                output_tokens=2,
                cached_tokens=0,
                num_preemptions=0,
            )
        )
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
