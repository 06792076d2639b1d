"""A stop string ends a request the same way for everyone: the state Redis settles, the client's answer, the
Prometheus counter and the span all read one row of the outcome table (services/gateway/session/outcome.py), however the
request was placed when its stop string completed (a worker can preempt it between two steps)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.edge.errors import GatewayError
from services.gateway.session.handle import RequestHandle
from services.gateway.session.outcome import ending
from services.gateway.session.drive import drive, final_body
from services.gateway.text.stop_strings import TextStream
from services.gateway.session.tracing import start_trace
from shared.state.context_store import ContextStore
from shared.wire.events import Sampling, TimedOut, TokenDelta
from shared.state.lifecycle import Lifecycle, Owner, State
from shared.text.tokenization import load_tokenizer
from tests.support.factories import request_received
from tests.support.inproc import gateway_core, small

TEXT, STOP = "The capital of France is Paris. It is", " Paris"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _created(redis_client, names, states: tuple[State, ...]) -> str:
    """A request created as the gateway does and moved through `states` as the pipeline does."""
    ev = request_received()
    store = ContextStore(redis_client, names, 60)
    keys, argv = store.create_args(ev.request_id, {"priority": 0}, {"prompt": ev.prompt, "prompt_tokens": 3}, ev)
    assert store._create(keys=keys, args=argv)[0] == b"ok"
    worker = Lifecycle(redis_client, names, "worker", 60)
    for to in states:
        assert worker.transition(ev.request_id, to, owner=Owner("w1", 1) if to == State.SCHEDULED else None).applied
    return ev.request_id


def _handle(core, rid: str, tokenizer) -> RequestHandle:
    h = RequestHandle(rid, core.reply_to, TextStream(tokenizer, [STOP]), time.time() + 60, time.perf_counter())
    h.trace = start_trace(rid, small(), Sampling(max_tokens=16), "test-model", "/generate", "", h.t0)
    core.handles[rid] = h
    h.created()
    return h


def test_a_stop_string_matched_while_preempted_ends_the_request_alike_in_redis_for_the_client_and_prometheus(
    redis_server, redis_client, names, tokenizer
):
    """The stop string completes in tokens of a step after which the worker preempted the request: FINISHED is not
    allowed from PREEMPTED. It used to be cancelled there (CANCELLED in Redis) while the client got "stop" and
    Prometheus counted a success; it is now finished once the worker takes it up again, as a stop."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    states = (State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.DECODING, State.PREEMPTED)

    async def run():
        core = gateway_core(redis_server.url, names)
        rid = _created(redis_client, names, states)
        h = _handle(core, rid, tokenizer)
        chunks = []

        async def consume():
            async for chunk in drive(core, h, None, watch=False):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        try:
            h.deliver(TokenDelta(rid, 0, tuple(ids)))
            await asyncio.sleep(0.5)
            worker = Lifecycle(redis_client, names, "worker", 60)
            for to in (State.PREFILLING, State.DECODING):  # recomputed, then the next token is decoded
                worker.transition(rid, to)
            h.deliver(TokenDelta(rid, len(ids), (ids[-1],)))
            await asyncio.wait_for(task, 10)
            body = await final_body(core, h)
        finally:
            task.cancel()
            core.release(h)
            await core.r.aclose()
        return rid, body, chunks[-1].end, core.metrics

    rid, body, end, metrics = asyncio.run(run())
    assert body["finish_reason"] == "stop" and body["text"] == TEXT[: TEXT.index(STOP)]
    meta = redis_client.hgetall(names.layer(rid, "meta"))
    assert meta[b"state"].decode() == ending(end).outcome.state.value == State.FINISHED.value
    assert meta[b"reason"] == b"stop_string"
    assert metrics.registry.get_sample_value("conveyor:request_success_total", {"finished_reason": "stop"}) == 1
    assert metrics.registry.get_sample_value("conveyor:cancellations_total", {"reason": "stop_string"}) is None


def test_a_request_preempted_after_its_stop_string_that_times_out_meanwhile_is_a_timeout_for_everyone(
    redis_server, redis_client, names, tokenizer
):
    """Waiting for the worker to take the request up again is bounded by its deadline: if the deadline comes first,
    the request's ending is the timeout Redis settled, for the client and Prometheus too."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    states = (State.PREPROCESSED, State.QUEUED, State.SCHEDULED, State.PREFILLING, State.DECODING, State.PREEMPTED)

    async def run():
        core = gateway_core(redis_server.url, names)
        rid = _created(redis_client, names, states)
        h = _handle(core, rid, tokenizer)
        chunks = []

        async def consume():
            async for chunk in drive(core, h, None, watch=False):
                chunks.append(chunk)

        task = asyncio.create_task(consume())
        try:
            h.deliver(TokenDelta(rid, 0, tuple(ids)))
            await asyncio.sleep(0.5)
            assert not task.done()  # not settled while preempted: it waits
            scheduler = Lifecycle(redis_client, names, "scheduler", 60)
            assert scheduler.transition(rid, State.TIMED_OUT, "deadline").applied
            h.deliver(TimedOut(request_id=rid, state=State.PREEMPTED, service="scheduler"))
            await asyncio.wait_for(task, 10)
            with pytest.raises(GatewayError) as raised:
                await final_body(core, h)
        finally:
            task.cancel()
            core.release(h)
            await core.r.aclose()
        return rid, raised.value, chunks[-1].end, core.metrics

    rid, error, end, metrics = asyncio.run(run())
    assert error.status == 504 and error.extra["partial"]["text"] == TEXT[: TEXT.index(STOP)]
    assert redis_client.hget(names.layer(rid, "meta"), "state").decode() == ending(end).outcome.state.value
    assert metrics.registry.get_sample_value("conveyor:timeouts_total") == 1
    assert metrics.registry.get_sample_value("conveyor:request_success_total", {"finished_reason": "stop"}) is None
