"""/generate's answer for any n (choices.py drives the choices): the native shapes.

n = 1: the choice's own body, {"request_id", "text", "token_ids", "finish_reason", "usage", "metrics"}; or SSE, one
event per text delta, then one final event, then [DONE].
n > 1: {"request_id" (the first choice's), "choices": [{"index", "request_id", "text", "token_ids",
"finish_reason", "usage", "metrics"}, ...], "usage"} with the request's usage (prompt once, completions summed).
SSE: each choice's deltas and final event as n = 1's with "choice": its index; once every choice ended,
{"request_id", "usage"} for the request; then [DONE]. A choice that fails ends the stream with its final event
(its error), its siblings cancelled.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request

from services.gateway.session.groups import ChoiceRun, Choices, accept_choices, collect_choices, merged_usage
from services.gateway.session.core import GatewayCore
from services.gateway.text.render import json_response, sse_events
from services.gateway.session.drive import chunk_weight, delta_event, final_event, handle_weight, sse
from services.gateway.session.request import GenerateRequest
from services.gateway.edge.sse import SseResponse


async def generate(request: Request, body: GenerateRequest):
    core: GatewayCore = request.app.state.core
    choices = await accept_choices(request, body, body.n)
    primary = choices.primary
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if body.stream:
        return SseResponse(_stream(core, choices, request), core.s.sse_write_timeout_s, headers=headers)
    bodies = await collect_choices(core, choices, request)
    return await json_response(lambda: _body(choices, bodies), sum(handle_weight(h) for h in choices.handles),
                               headers)


def _body(choices: Choices, bodies: list[dict]) -> dict:
    if len(bodies) == 1:  # a request of one choice answers with that choice's body
        return bodies[0]
    return {"request_id": choices.primary.request_id, "choices": [{"index": i, **b} for i, b in enumerate(bodies)],
            "usage": merged_usage(bodies)}


def _of(event: dict, index: int, n: int) -> dict:
    """A choice's event: with n > 1 it names its choice."""
    return {**event, "choice": index} if n > 1 else event


async def _stream(core: GatewayCore, choices: Choices, request: Request) -> AsyncIterator[bytes]:
    run = ChoiceRun(core, choices, request)
    n, finals = len(choices.handles), {}
    failed = False
    try:
        while len(finals) < n:
            index, chunk = await run.next()
            handle = choices.handles[index]
            if chunk.end is None:
                if chunk.token_ids or chunk.text:
                    yield await sse_events(lambda: [_of(delta_event(core, handle, chunk), index, n)],
                                           chunk_weight(chunk))
                continue
            final = _of(await final_event(core, handle, chunk), index, n)
            yield sse(final)
            if "error" in final:  # one outcome for the request: close() cancels the siblings
                failed = True
                break
            finals[index] = final
        if n > 1 and len(finals) == n:
            yield sse({"request_id": choices.primary.request_id,
                       "usage": merged_usage([finals[i] for i in range(n)])})
        yield sse("[DONE]")
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once
