"""OpenAI's answer for any n (choices.py drives the choices): one body with n choices, or one stream whose chunks
each carry their choice's `index` (openai_stream.Shape builds each one; n = 1 is a group of one).

Non-stream: the choices in index order, `usage` for the whole request (prompt once, completion tokens summed).
Stream: it answers once the first output of any choice (or the end) is known, so a request whose choices fail before
any output (a prompt too long, timed out in the queue) gets that error's own HTTP status instead of a 200 followed
by an error event. Then each choice's text deltas as they come, interleaved, each chunk naming its choice; a
choice's finish_reason in a chunk of its own when it ends; the usage chunk (stream_options.include_usage) once all
have ended; [DONE]. An error after the start ends the stream with `data: {"error": {...}}` (the official client
raises it), its siblings cancelled, then `data: [DONE]` as always.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request

from services.gateway.session.groups import (ChoiceRun, Choices, accept_choices, collect_choices, first_outcome,
                                            merged_usage)
from services.gateway.session.core import GatewayCore
from services.gateway.edge.errors import GatewayError
from services.gateway.session.handle import Chunk
from services.gateway.openai.stream import Shape, end_chunks, openai_usage, text_chunks
from services.gateway.openai.tools import ToolShaper
from services.gateway.text.render import json_response, sse_events
from services.gateway.session.drive import chunk_weight, handle_weight, sse
from services.gateway.session.request import GenerateRequest
from services.gateway.openai.structured_output import OutputPlan
from services.gateway.edge.sse import SseResponse
from shared.events import Completed


def _at(out: dict, index: int) -> dict:
    """A one-choice body or chunk built by Shape, for choice `index`."""
    for choice in out["choices"]:
        choice["index"] = index
    return out


def choices_body(shapes: list[Shape], choices: Choices, bodies: list[dict]) -> dict:
    """The non-stream answer from the choices' native bodies (and their handles' log probabilities)."""
    outs = [_at(shapes[i].body(b, choices.handles[i].logprobs), i) for i, b in enumerate(bodies)]
    out = outs[0]
    out["choices"] = [o["choices"][0] for o in outs]
    out["usage"] = openai_usage(merged_usage(bodies))
    return out


async def serve(request: Request, native: GenerateRequest, n: int, chat: bool, meta: dict, include_usage: bool,
                default_max_tokens: int | None, plan: OutputPlan = OutputPlan()):
    core: GatewayCore = request.app.state.core
    choices = await accept_choices(request, native, n, default_max_tokens, meta, constraint=plan.constraint,
                                   tools=plan.tools_json)
    primary = choices.primary
    # One Shape per choice: a completion's log probabilities carry a text offset that runs on within its choice.
    shapes = [Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{primary.request_id}", int(time.time()), core.model_name,
                    include_usage, core.token_strings if native.logprobs is not None else None, plan)
              for _ in range(n)]
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if native.stream:
        return await _start_stream(request, core, choices, shapes, headers)
    # The log probabilities are shaped from the handles (Shape.body), not from the native bodies.
    bodies = await collect_choices(core, choices, request, with_logprobs=False)
    return await json_response(lambda: choices_body(shapes, choices, bodies),
                               sum(handle_weight(h) for h in choices.handles), headers)


async def _start_stream(request: Request, core: GatewayCore, choices: Choices, shapes: list[Shape],
                        headers: dict) -> SseResponse:
    """Wait for the first output (or end) of any choice, then answer with the stream (or raise the error)."""
    run = ChoiceRun(core, choices, request)
    try:
        first = await run.next()
        if first[1].end is not None and not isinstance(first[1].end, Completed):
            await first_outcome(core, run, *first, with_logprobs=False)  # raises the GatewayError of this ending
    except BaseException as e:
        run.close(isinstance(e, GatewayError))
        raise
    return SseResponse(_events(core, run, shapes, first), core.s.sse_write_timeout_s, headers=headers)


async def _events(core: GatewayCore, run: ChoiceRun, shapes: list[Shape],
                  first: tuple[int, Chunk]) -> AsyncIterator[bytes]:
    n, shape = len(run.choices.handles), shapes[0]
    tools = [ToolShaper(s.plan) if s.with_tools else None for s in shapes]  # each choice's tool call, if any
    bodies: dict[int, dict] = {}
    failed = False
    try:
        if shape.chat:
            for i in range(n):
                yield sse(_at(shape.chunk(role=True), i))
        index, chunk = first
        while True:
            if data := await sse_events(lambda: [_at(out, index) for out in text_chunks(shapes[index], tools[index],
                                                                                        chunk)],
                                        chunk_weight(chunk)):
                yield data
            try:
                body = await first_outcome(core, run, index, chunk, with_logprobs=False)
            except GatewayError as e:  # one outcome for the request: its siblings are cancelled by close()
                failed = True
                yield sse(e.body())
                break
            if body is not None:
                bodies[index] = body
                for out in end_chunks(shapes[index], tools[index], body["finish_reason"]):
                    yield sse(_at(out, index))
                if len(bodies) == n:
                    if shape.include_usage:
                        yield sse(shape.usage_chunk(merged_usage([bodies[i] for i in range(n)])))
                    break
            index, chunk = await run.next()
        yield sse("[DONE]")
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once
