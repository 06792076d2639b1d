"""The one way in for every API: checks a schema cannot express, then submission.

/generate and the OpenAI endpoints all build a GenerateRequest and come through here, so a
rule (prompt xor messages, the max_tokens limit, back-pressure, the owner's key) is written once.
"""

from __future__ import annotations

from fastapi import Request

from services.gateway.edge.auth import caller, is_admin
from services.gateway.edge.errors import InvalidRequest
from services.gateway.session.handle import RequestHandle
from services.gateway.session.request import GenerateRequest
from shared.events import Constraint


async def accept(request: Request, body: GenerateRequest, default_max_tokens: int | None = None,
                 extra_meta: dict | None = None, constraint: Constraint | None = None, tools: str = "",
                 **choice) -> RequestHandle:
    """Validate, apply back-pressure and submit; returns the handle to drive (raises GatewayError). constraint and
    tools: what structured_output.plan_chat decided (already checked). choice: a choice of an n > 1 request
    (choices.py) gives its request_id, group_id, group_size and traceparent."""
    core = request.app.state.core
    if (body.prompt is None) == (body.messages is None):
        which = "both were given" if body.prompt is not None else "neither was given"
        raise InvalidRequest(f"give exactly one of prompt or messages ({which})", "prompt", "prompt_or_messages")
    vocab = len(core.tokenizer)  # the worker would refuse an id beyond it, as its own error (a 500)
    if any(t >= vocab for t in body.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids: every id must be below the vocabulary size {vocab}", "stop_token_ids",
                             "token_id_out_of_range")
    limit = min(core.s.max_tokens_limit, request.app.state.max_len - 1)
    max_tokens = body.max_tokens or min(default_max_tokens or core.s.default_max_tokens, limit)
    if max_tokens > limit:
        raise InvalidRequest(f"max_tokens: must be at most {limit} (got {max_tokens})", "max_tokens",
                             "max_tokens_too_large")
    if caller(request) and not is_admin(request) and body.priority < core.s.priority_floor:
        # An urgent priority is an entitlement: one key at -1000 would starve every other key until their timeouts.
        extra_meta = {**(extra_meta or {}), "priority_requested": body.priority}
        body = body.model_copy(update={"priority": core.s.priority_floor})
    traceparent = choice.pop("traceparent", None) or request.headers.get("traceparent", "")
    return await core.submit(body, max_tokens, owner=caller(request), extra_meta=extra_meta,
                             traceparent=traceparent, route=request.url.path, constraint=constraint, tools=tools,
                             **choice)
