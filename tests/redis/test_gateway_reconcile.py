"""A reply the gateway's reader missed or has not read yet: an ending rebuilt from the context only when it is truly
lost (never for one still unread, never for a request still being created), tokens after a gap completed from the
request's tokens list."""

from __future__ import annotations

import asyncio
import time


from services.gateway.session.handle import RequestHandle
from shared.wire.constants import EVENT_FIELD
from services.gateway.session import reconcile
from shared.state.context_store import ContextStore
from shared.wire.events import Completed, TokenDelta, TokenGenerated, encode
from shared.state.lifecycle import Lifecycle, Owner, State
from tests.support.factories import completed, request_received
from tests.support.inproc import gateway_core, started


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
            {EVENT_FIELD: encode(completed(rid, "length", prompt_tokens=1, output_tokens=0, worker_id="w1"))},
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
        async with started(gateway_core(redis_server.url, names)) as core:
            h = _silent_handle(core, "r-being-created", created=False)
            async with asyncio.timeout(10):
                while core.replies_read_to - h.last_event_at <= reconcile.SILENT_S + 1:
                    await asyncio.sleep(0.05)  # the reader has read past the point where it counts as silent
            await reconcile.repair_silent(core)
            assert h.queue.empty()

    asyncio.run(run())


def test_a_silent_request_settled_without_its_ending_gets_it_built_from_the_context(redis_server, redis_client, names):
    async def run():
        async with started(
            gateway_core(redis_server.url, names)
        ) as core:  # its reader reads the (empty) reply stream: it is not behind
            h = _silent_handle(core, _finished(redis_client, names))
            async with asyncio.timeout(10):
                while h.queue.empty():
                    await reconcile.repair_silent(core)
                    await asyncio.sleep(0.1)
            end = h.queue.get_nowait()
            assert isinstance(end, Completed) and end.finish_reason == "length"

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
