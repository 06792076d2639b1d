"""The native API: POST /generate, for any n (one request of its own per choice, session.intake.accept_choices).

JSON: n = 1, the choice's own body: {"request_id", "text", "token_ids", "finish_reason", "usage", "metrics"} (and
"logprobs" when asked for); n > 1, {"request_id" (the first choice's), "choices": [{"index", ...the choice's
body}, ...], "usage"} with the request's usage (prompt once, completions summed). With "stream": native.stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from services.gateway.edge.deps import Core
from services.gateway.edge.openapi_doc import GENERATION_ERRORS, sse_or_json
from services.gateway.edge.sse import SseResponse
from services.gateway.native.stream import stream
from services.gateway.session.drive import collect_choices, handle_weight, merged_usage
from services.gateway.session.intake import accept_choices
from services.gateway.session.request import GenerateRequest
from services.gateway.openai.structured_output import native_constraint
from services.gateway.session.timing import queue_time_headers
from services.gateway.text.render import HEAVY, json_response, off_loop

if TYPE_CHECKING:
    from services.gateway.session.handle import Choices

router = APIRouter()


@router.post("/generate", responses={**sse_or_json(None, "the output (JSON, or SSE with stream)"), **GENERATION_ERRORS})
async def generate(body: GenerateRequest, request: Request, core: Core):
    weight = HEAVY if body.grammar is not None else 0
    constraint = await off_loop(lambda: native_constraint(body), weight)  # its grammar compiled off the loop
    choices = await accept_choices(core, request, body, body.n, constraint=constraint)
    primary = choices.primary
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if body.stream:
        return SseResponse(stream(core, choices, request), core.s.sse_write_timeout_s, headers=headers)
    bodies = await collect_choices(core, choices, request)
    headers.update(queue_time_headers((primary.metrics or {}).get("queue_wait")))
    return await json_response(lambda: _body(choices, bodies), sum(handle_weight(h) for h in choices.handles), headers)


def _body(choices: Choices, bodies: list[dict]) -> dict:
    if len(bodies) == 1:  # a request of one choice answers with that choice's body
        return bodies[0]
    return {
        "request_id": choices.primary.request_id,
        "choices": [{"index": i, **b} for i, b in enumerate(bodies)],
        "usage": merged_usage(bodies, choices.per_prompt),
    }
