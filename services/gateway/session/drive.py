"""Driving a request's choices to their end: one choice's chunks (`drive`), its ending's native body (`final_body`),
and a request's choices, one or more, driven together (`ChoiceRun`).

Every API drives its requests here, whatever n; native.stream and openai.stream only shape what the client gets.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

import redis

from services.gateway.edge.errors import GatewayError
from services.gateway.session.outcome import CLIENT_GONE, SIBLING_FAILED, ending
from services.gateway.session.stop import finish_at_stop
from services.gateway.session.timing import request_metrics
from services.gateway.text import logprobs as lp_shapes
from shared.wire.events import PromptLogprobs, TimedOut

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices, Chunk, RequestHandle

logger = logging.getLogger(__name__)

DEADLINE_GRACE_S = 2.0  # the scheduler/worker report timeouts; the gateway settles only if they did not
MIN_WAIT_S = 0.05  # shortest wait for output (a deadline just passed is looked at again this soon)


async def drive(core: GatewayCore, handle: RequestHandle, request: Request, watch: bool = True) -> AsyncIterator[Chunk]:
    """Chunks until the terminal one; cancels on client disconnect, times out as a backstop.

    A waiting request sleeps until output arrives, its client leaves (a watcher task wakes it) or its deadline's
    backstop is due: no periodic poll. (A poll of the client every half second cost a gateway holding 5,000
    waiting streams 10,000 wakeups a second, half of its time.) watch=False: the caller watches the client (the
    choices of a request share one connection, whose disconnect receive() answers only once: ChoiceRun)."""
    asked_cancel = asked_timeout = False
    watcher = asyncio.ensure_future(watch_disconnect(request, [handle])) if watch else None
    try:
        while True:
            grace = DEADLINE_GRACE_S * (2 if asked_timeout else 1)
            chunk = await handle.next_chunk(max(MIN_WAIT_S, handle.remaining() + grace))
            if chunk is not None:
                yield chunk
                if chunk.end is not None:
                    return
                if handle.stop_matched is not None:  # a stop string ended the output: settle it here, now
                    if (end := await finish_at_stop(core, handle)) is not None:
                        yield end
                        return
                continue
            if handle.client_gone and not asked_cancel:
                asked_cancel = True
                await core.cancel(handle.request_id, CLIENT_GONE, handle.reply_to)
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


async def watch_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """Wait for the client to leave (its body is read: receive() now only answers http.disconnect, when the
    connection closes or the response is complete), then wake the handler of each of its requests' choices."""
    while (await request.receive())["type"] != "http.disconnect":
        continue
    for handle in handles:
        handle.client_gone = True
        handle.wake()


async def final_body(core: GatewayCore, handle: RequestHandle, with_logprobs: bool = True) -> dict:
    """The success body, or raise the GatewayError the terminal event calls for. with_logprobs=False: a stream's
    end, whose log probabilities went out with its chunks."""
    end, how = handle.ended, ending(handle.ended)
    partial = {"text": handle.full_text, "token_ids": handle.token_ids}
    ids = {"X-Request-Id": handle.request_id, "traceparent": handle.trace.traceparent}
    extra = {"partial": partial, "request_id": handle.request_id}
    metrics = handle.metrics = await request_metrics(core, handle)
    if how.outcome.ok:
        body = {
            "request_id": handle.request_id,
            "text": handle.full_text,
            "token_ids": handle.token_ids,
            "finish_reason": how.reason,
            "usage": {
                "prompt_tokens": end.prompt_tokens,
                "completion_tokens": len(handle.token_ids),
                "total_tokens": end.prompt_tokens + len(handle.token_ids),
                "cached_tokens": end.cached_tokens,
            },
            "metrics": metrics,
        }
        if handle.logprobs is not None and with_logprobs:  # made as the answer is encoded (render.Sliced)
            body["logprobs"] = lp_shapes.native_sliced(core.token_strings, handle.token_ids, handle.logprobs)
        if handle.prompt is not None and with_logprobs:
            body.update(prompt_fields(core, handle.prompt))
        try:
            await core.store.update(core.r, handle.request_id, "output", {"text": handle.full_text, "metrics": metrics})
        except redis.RedisError as e:  # bookkeeping after the end: the client still gets the finished answer
            logger.warning("request %s: output layer not written (%r)", handle.request_id, e)
        return body
    raise how.error(extra, ids, getattr(end, "retry_after_s", 0))


def prompt_fields(core: GatewayCore, prompt: PromptLogprobs) -> dict:
    """A native body's (or stream event's) prompt: its token ids and their log probabilities (vLLM's shape)."""
    return {
        "prompt_token_ids": list(prompt.token_ids),
        "prompt_logprobs": lp_shapes.prompt_vllm(core.token_strings, prompt),
    }


def chunk_weight(chunk: Chunk) -> int:
    """How heavy the events of a chunk are to build and encode (render.HEAVY)."""
    return len(chunk.token_ids) + lp_shapes.weight(chunk.logprobs) + lp_shapes.prompt_weight(chunk.prompt)


def handle_weight(handle: RequestHandle) -> int:
    """How heavy a request's whole answer is to build and encode (render.HEAVY)."""
    return len(handle.token_ids) + lp_shapes.weight(handle.logprobs) + lp_shapes.prompt_weight(handle.prompt)


@dataclass
class ChoiceRun:
    """The choices driven together: one task per choice puts its chunks on one queue, read in arrival order (a
    group of one is read straight from its drive: no task, no queue). One watcher of the client for all
    (receive() answers the disconnect once): it wakes every choice, whose drive loop then cancels it."""

    core: GatewayCore
    choices: Choices
    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    only: AsyncIterator[Chunk] | None = None  # the drive of a group of one

    def __post_init__(self) -> None:
        handles = self.choices.handles
        if len(handles) == 1:
            self.only = drive(self.core, handles[0], self.request, watch=False)
        else:
            self.tasks = [asyncio.ensure_future(self._pump(i, h)) for i, h in enumerate(handles)]
        self.tasks.append(asyncio.ensure_future(watch_disconnect(self.request, handles)))

    async def _pump(self, index: int, handle: RequestHandle) -> None:
        try:
            async for chunk in drive(self.core, handle, self.request, watch=False):
                self.queue.put_nowait((index, chunk))
        except Exception as e:  # to the reader, who raises it; a cancellation (close) just ends the task
            self.queue.put_nowait((index, e))

    async def next(self) -> tuple[int, Chunk]:
        """The next chunk of any choice, with the choice's index."""
        if self.only is not None:
            return 0, await anext(self.only)
        index, item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return index, item

    def close(self, failed: bool) -> None:
        """Stop driving; choices not ended are cancelled (in tasks of their own), every handle released. failed: a
        choice ended the request (else the handler was cancelled or errored: the client left). No
        await: this runs in a handler that may be being cancelled."""
        for t in self.tasks:
            t.cancel()
        gone = not failed or any(h.client_gone for h in self.choices.handles)
        for h in self.choices.handles:
            if h.ended is None:
                self.core.abandon(h, CLIENT_GONE if gone else SIBLING_FAILED)
            self.core.release(h)


async def started_run(core: GatewayCore, choices: Choices, request) -> tuple[ChoiceRun, tuple[int, Chunk]]:
    """A stream's start: drive the choices until the first output (or end) of any, -> (the run, that chunk). A
    request that failed before any output raises its GatewayError here (its client gets the status, not a 200
    stream); the run is closed then."""
    run = ChoiceRun(core, choices, request)
    try:
        first = await run.next()
        if first[1].end is not None and not ending(first[1].end).outcome.ok:
            await first_outcome(core, run, *first, with_logprobs=False)  # raises the GatewayError of this ending
    except BaseException as e:
        run.close(isinstance(e, GatewayError))
        raise
    return run, first


async def first_outcome(
    core: GatewayCore, run: ChoiceRun, index: int, chunk: Chunk, with_logprobs: bool = True
) -> dict | None:
    """A choice's native body once it ended (None while it has not); raises the GatewayError of one that did not
    complete (the caller then closes the run, which cancels its siblings). with_logprobs: final_body's."""
    if chunk.end is None:
        return None
    return await final_body(core, run.choices.handles[index], with_logprobs)  # raises unless it completed


async def collect_choices(
    core: GatewayCore, choices: Choices, request: Request, with_logprobs: bool = True
) -> list[dict]:
    """Every choice's native body (text, finish_reason, usage), in choice order; or the first error."""
    run = ChoiceRun(core, choices, request)
    bodies: dict[int, dict] = {}
    failed = False
    try:
        while len(bodies) < len(choices.handles):
            index, chunk = await run.next()
            try:
                body = await first_outcome(core, run, index, chunk, with_logprobs)
            except GatewayError:
                failed = True
                raise
            if body is not None:
                bodies[index] = body
        return [bodies[i] for i in range(len(choices.handles))]
    finally:
        run.close(failed)


def merged_usage(bodies: list[dict], per_prompt: int = 0) -> dict:
    """The request's usage: each prompt once, the completion tokens of every choice (as OpenAI and vLLM count
    them); a prompt's cached tokens are those the first prefill of it found cached (the smallest of its choices:
    the others reuse what that prefill computed). per_prompt: choices per prompt (Choices.per_prompt; 0: one
    prompt)."""
    per = per_prompt or len(bodies)
    groups = [bodies[i : i + per] for i in range(0, len(bodies), per)]
    prompt = sum(g[0]["usage"]["prompt_tokens"] for g in groups)
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_tokens": sum(min(b["usage"].get("cached_tokens", 0) for b in g) for g in groups),
    }
