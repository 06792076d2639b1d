"""Driving one request to its end and shaping what the client gets (JSON or SSE)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import redis
from fastapi import Request

from services.gateway.core import GatewayCore
from services.gateway.errors import (GatewayError, InvalidRequest, Overloaded, RequestCancelled, RequestFailed,
                                     RequestTimedOut, Unavailable)
from services.gateway.handle import Chunk, RequestHandle
from services.gateway import logprobs as lp_shapes
from services.gateway.metrics import request_metrics
from services.gateway.render import sse_events
from services.gateway.stop_finish import finish_at_stop
from shared.events import Cancelled, Completed, Failed, TimedOut

logger = logging.getLogger(__name__)

DEADLINE_GRACE_S = 2.0  # the scheduler/worker report timeouts; the gateway settles only if they did not
MIN_WAIT_S = 0.05  # shortest wait for output (a deadline just passed is looked at again this soon)


async def drive(core: GatewayCore, handle: RequestHandle, request: Request,
                watch: bool = True) -> AsyncIterator[Chunk]:
    """Chunks until the terminal one; cancels on client disconnect, times out as a backstop.

    A waiting request sleeps until output arrives, its client leaves (a watcher task wakes it) or its deadline's
    backstop is due: no periodic poll. (A poll of the client every half second cost a gateway holding 5,000
    waiting streams 10,000 wakeups a second, half of its time.) watch=False: the caller watches the client (the
    choices of an n > 1 request share one connection, whose disconnect receive() answers only once)."""
    asked_cancel = asked_timeout = False
    watcher = asyncio.ensure_future(_watch_disconnect(request, handle)) if watch else None
    try:
        while True:
            grace = DEADLINE_GRACE_S * (2 if asked_timeout else 1)
            chunk = await handle.next_chunk(max(MIN_WAIT_S, handle.remaining() + grace))
            if chunk is not None:
                yield chunk
                if chunk.end is not None:
                    return
                if handle.stop_matched is not None:  # a stop string ended the output: settle it here, now
                    yield await finish_at_stop(core, handle)
                    return
                continue
            if handle.client_gone and not asked_cancel:
                asked_cancel = True
                await core.cancel(handle.request_id, "client_disconnect", handle.reply_to)
            elif handle.remaining() < -grace:
                # First backstop: settle TIMED_OUT in Redis (the event comes back through the reply stream).
                # Second, a grace later: nothing came (Redis lost the request, or is away): answer from here.
                if asked_timeout or not await core.time_out(handle):
                    yield handle.finish(TimedOut(request_id=handle.request_id, service="gateway"))
                    return
                asked_timeout = True
    finally:
        if watcher is not None:
            watcher.cancel()


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Wait for the client to leave (its body is read: receive() now only answers http.disconnect, when the
    connection closes or the response is complete), then wake the request's handler."""
    while (await request.receive())["type"] != "http.disconnect":
        continue
    handle.client_gone = True
    handle.wake()


async def final_body(core: GatewayCore, handle: RequestHandle, with_logprobs: bool = True) -> dict:
    """The success body, or raise the GatewayError the terminal event calls for. with_logprobs=False: a stream's
    end, whose log probabilities went out with its chunks."""
    end = handle.ended
    partial = {"text": handle.full_text, "token_ids": handle.token_ids}
    ids = {"X-Request-Id": handle.request_id, "traceparent": handle.trace.traceparent}
    extra = {"partial": partial, "request_id": handle.request_id}
    metrics = handle.metrics = await request_metrics(core, handle)
    if isinstance(end, Completed):
        body = {"request_id": handle.request_id, "text": handle.full_text, "token_ids": handle.token_ids,
                "finish_reason": end.finish_reason,
                "usage": {"prompt_tokens": end.prompt_tokens, "completion_tokens": len(handle.token_ids),
                          "total_tokens": end.prompt_tokens + len(handle.token_ids),
                          "cached_tokens": end.cached_tokens},
                "metrics": metrics}
        if handle.logprobs is not None and with_logprobs:  # made as the answer is encoded (render.Sliced)
            body["logprobs"] = lp_shapes.native_sliced(core.token_strings, handle.token_ids, handle.logprobs)
        try:
            await core.store.update(core.r, handle.request_id, "output", {"text": handle.full_text, "metrics": metrics})
        except redis.RedisError as e:  # bookkeeping after the end: the client still gets the finished answer
            logger.warning("request %s: output layer not written (%r)", handle.request_id, e)
        return body
    if isinstance(end, Failed):
        if end.reason in ("invalid", "too_long"):
            raise InvalidRequest(end.message, end.param or None, end.reason, headers=ids)
        if end.reason in ("worker_lost", "state_lost"):
            raise Unavailable(end.message, None, end.reason, extra=extra, headers=ids)
        if end.reason == "overloaded":  # refused by the scheduler before it could start: nothing ran
            raise Overloaded(end.message, None, end.reason, headers={**ids, "Retry-After": str(end.retry_after_s)})
        raise RequestFailed(end.message, None, end.reason, extra=extra, headers=ids)
    if isinstance(end, TimedOut):
        where = end.state or end.service or "unknown"
        raise RequestTimedOut(f"the request did not finish within its timeout (it was {where})", "timeout",
                              "timeout", extra=extra, headers=ids)
    if isinstance(end, Cancelled):
        raise RequestCancelled(f"the request was cancelled ({end.reason})", None, end.reason,
                               extra=extra, headers=ids)
    raise RequestFailed(f"unexpected end event {type(end).__name__}", None, "internal")


async def collect(core: GatewayCore, handle: RequestHandle, request: Request, with_logprobs: bool = True) -> dict:
    try:
        async for _chunk in drive(core, handle, request):
            pass
        return await final_body(core, handle, with_logprobs)
    finally:
        if handle.ended is None:  # the handler was cancelled (client gone, shutdown) before the end
            core.abandon(handle, "client_disconnect")
        core.release(handle)


def sse(data: dict | str) -> bytes:
    """One light SSE event (a heavy one goes through render.sse_events, which writes the same bytes)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def chunk_weight(chunk: Chunk) -> int:
    """How heavy the events of a chunk are to build and encode (render.HEAVY)."""
    return len(chunk.token_ids) + lp_shapes.weight(chunk.logprobs)


def handle_weight(handle: RequestHandle) -> int:
    """How heavy a request's whole answer is to build and encode (render.HEAVY)."""
    return len(handle.token_ids) + lp_shapes.weight(handle.logprobs)


async def stream(core: GatewayCore, handle: RequestHandle, request: Request) -> AsyncIterator[bytes]:
    """SSE: one event per text delta (with its token ids), then one final event, then [DONE]."""
    try:
        async for chunk in drive(core, handle, request):
            if chunk.end is None:
                if chunk.token_ids or chunk.text:
                    yield await sse_events(lambda: [delta_event(core, handle, chunk)], chunk_weight(chunk))
                continue
            yield sse(await final_event(core, handle, chunk))
            yield sse("[DONE]")
    finally:
        if handle.ended is None:  # the client went away mid-stream: no await here (this task is being cancelled)
            core.abandon(handle, "client_disconnect")
        core.release(handle)


def delta_event(core: GatewayCore, handle: RequestHandle, chunk: Chunk) -> dict:
    """/generate's SSE event of one text delta: its text, token ids and (when asked for) their log probabilities."""
    event = {"request_id": handle.request_id, "index": chunk.index, "text": chunk.text, "token_ids": chunk.token_ids}
    if chunk.logprobs is not None:
        event["logprobs"] = lp_shapes.native_sliced(core.token_strings, chunk.token_ids, chunk.logprobs)
    return event


async def final_event(core: GatewayCore, handle: RequestHandle, chunk: Chunk) -> dict:
    out = {"request_id": handle.request_id, "index": chunk.index, "text": chunk.text, "token_ids": []}
    try:
        body = await final_body(core, handle, with_logprobs=False)
    except GatewayError as e:
        reason = {504: "timeout", 499: "cancelled"}.get(e.status, "error")
        return {**out, "finish_reason": reason, "error": e.body()["error"]}
    return {**out, "finish_reason": body["finish_reason"], "usage": body["usage"], "metrics": body["metrics"]}
