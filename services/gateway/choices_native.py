"""/generate with n > 1 (choices.py drives the choices): the native shapes, one entry or event per choice.

JSON: {"request_id" (the first choice's), "choices": [{"index", "request_id", "text", "token_ids",
"finish_reason", "usage", "metrics"}, ...], "usage"} with the request's usage (prompt once, completions summed).
SSE: each choice's deltas as /generate's with "choice": its index; each choice's final event likewise; once every
choice ended, {"request_id", "usage"} for the request; then [DONE]. A choice that fails ends the stream with its
final event (its error), its siblings cancelled.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request

from services.gateway.choices import ChoiceRun, Choices, accept_choices, collect_choices, merged_usage
from services.gateway.core import GatewayCore
from services.gateway.render import json_response, sse_events
from services.gateway.responses import chunk_weight, delta_event, final_event, handle_weight, sse
from services.gateway.schemas import GenerateRequest
from services.gateway.sse import SseResponse


async def generate_choices(request: Request, body: GenerateRequest):
    core: GatewayCore = request.app.state.core
    choices = await accept_choices(request, body, body.n)
    primary = choices.primary
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if body.stream:
        return SseResponse(_stream(core, choices, request), core.s.sse_write_timeout_s, headers=headers)
    bodies = await collect_choices(core, choices, request)
    out = {"request_id": primary.request_id, "choices": [{"index": i, **b} for i, b in enumerate(bodies)],
           "usage": merged_usage(bodies)}
    return await json_response(lambda: out, sum(handle_weight(h) for h in choices.handles), headers)


async def _stream(core: GatewayCore, choices: Choices, request: Request) -> AsyncIterator[bytes]:
    run = ChoiceRun(core, choices, request)
    finals: dict[int, dict] = {}
    failed = False
    try:
        while len(finals) < len(choices.handles):
            index, chunk = await run.next()
            handle = choices.handles[index]
            if chunk.end is None:
                if chunk.token_ids or chunk.text:
                    yield await sse_events(lambda: [{**delta_event(core, handle, chunk), "choice": index}],
                                           chunk_weight(chunk))
                continue
            final = {**await final_event(core, handle, chunk), "choice": index}
            yield sse(final)
            if "error" in final:  # one outcome for the request: close() cancels the siblings
                failed = True
                break
            finals[index] = final
        if len(finals) == len(choices.handles):
            yield sse({"request_id": choices.primary.request_id,
                       "usage": merged_usage([finals[i] for i in range(len(finals))])})
        yield sse("[DONE]")
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once
