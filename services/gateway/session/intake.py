"""The one way in for every API: checks a schema cannot express, then submission of each choice.

/generate and the OpenAI endpoints all build a GenerateRequest and come through here, so a
rule (prompt xor messages, the max_tokens limit, back-pressure, the owner's key) is written once.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from services.gateway.conversation import turns
from services.gateway.edge.auth import caller, is_admin
from services.gateway.edge.errors import InvalidRequest
from services.gateway.session.groups import choice_body
from services.gateway.session.handle import Choices
from services.gateway.session.outcome import SIBLING_FAILED
from shared.chat_template import kwargs_problem
from shared.sessions import end_turn

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle
    from services.gateway.native.tokenize import TokenizeRequest
    from services.gateway.session.request import GenerateRequest
    from shared.events import Constraint


async def accept_choices(
    core: GatewayCore,
    request: Request,
    body: GenerateRequest,
    n: int,
    default_max_tokens: int | None = None,
    extra_meta: dict | None = None,
    **output,
) -> Choices:
    """Create the n choices, the first first (its trace holds the others'); all or none (raises GatewayError).
    output: accept's constraint and tools, the same for every choice."""
    if n == 1:  # a group of one: no group id, no seed offset
        return Choices([await accept(core, request, body, default_max_tokens, extra_meta, **output)])
    if turns.session_id_of(request, body.session_id) is not None:
        raise InvalidRequest(
            f"n: a session's turn has one answer to continue from (got n={n}); send n > 1 without a session",
            "n",
            "session_with_n",
        )
    ids = [uuid.uuid4().hex for _ in range(n)]
    handles: list[RequestHandle] = []
    try:
        for i, rid in enumerate(ids):
            meta = {**(extra_meta or {}), "group_id": ids[0], "choice_index": i, "n": n}
            if i == 0:
                meta["group_members"] = ids  # what a cancel of any choice reads (groups.members)
            tp = handles[0].trace.traceparent if handles else None
            handles.append(
                await accept(
                    core,
                    request,
                    choice_body(body, i),
                    default_max_tokens,
                    meta,
                    request_id=rid,
                    group_id=ids[0],
                    group_size=n,
                    traceparent=tp,
                    **output,
                )
            )
    except BaseException:
        for h in handles:  # refused whole: what was created is cancelled (in tasks: this may be a cancellation)
            core.abandon(h, SIBLING_FAILED)
        raise
    return Choices(handles)


def check_chat_options(body: GenerateRequest | TokenizeRequest) -> None:
    """How the chat template is to write the messages: vLLM's rules (raises a 400 naming the field); /tokenize's
    body has the same fields."""
    options = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"} & body.model_fields_set
    if body.messages is None and options:
        field = sorted(options)[0]
        raise InvalidRequest(f"{field}: only with messages (a chat)", field, "invalid_value")
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message: cannot be true with add_generation_prompt true (as vLLM); "
            "set add_generation_prompt to false to continue the last message",
            "continue_final_message",
            "invalid_value",
        )
    problem = kwargs_problem(body.chat_template_kwargs) if body.chat_template_kwargs else None
    if problem is not None:
        param = "chat_template_kwargs" + (f".{problem[0]}" if problem[0] else "")
        raise InvalidRequest(f"{param}: {problem[1]}", param, "invalid_value")


async def accept(
    core: GatewayCore,
    request: Request,
    body: GenerateRequest,
    default_max_tokens: int | None = None,
    extra_meta: dict | None = None,
    constraint: Constraint | None = None,
    tools: str = "",
    **choice,
) -> RequestHandle:
    """Validate, apply back-pressure and submit; returns the handle to drive (raises GatewayError). constraint and
    tools: what openai.structured_output.plan_chat decided (already checked). choice: a choice of an n > 1 request
    (accept_choices) gives its request_id, group_id, group_size and traceparent."""
    if (body.prompt is None) == (body.messages is None):
        which = "both were given" if body.prompt is not None else "neither was given"
        raise InvalidRequest(f"give exactly one of prompt or messages ({which})", "prompt", "prompt_or_messages")
    check_chat_options(body)
    vocab = len(core.tokenizer)  # the worker would refuse an id beyond it, as its own error (a 500)
    if any(t >= vocab for t in body.stop_token_ids):
        raise InvalidRequest(
            f"stop_token_ids: every id must be below the vocabulary size {vocab}",
            "stop_token_ids",
            "token_id_out_of_range",
        )
    if any(int(t) >= vocab for t in body.logit_bias or {}):
        raise InvalidRequest(
            f"logit_bias: every token id must be below the vocabulary size {vocab}",
            "logit_bias",
            "token_id_out_of_range",
        )
    limit = min(core.s.max_tokens_limit, core.max_len - 1) if core.max_len else core.s.max_tokens_limit
    max_tokens = body.max_tokens or min(default_max_tokens or core.s.default_max_tokens, limit)
    if max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens: must be at most {limit} (got {max_tokens})", "max_tokens", "max_tokens_too_large"
        )
    if caller(request) and not is_admin(request) and body.priority < core.s.priority_floor:
        # An urgent priority is an entitlement: one key at -1000 would starve every other key until their timeouts.
        extra_meta = {**(extra_meta or {}), "priority_requested": body.priority}
        body = body.model_copy(update={"priority": core.s.priority_floor})
    traceparent = choice.pop("traceparent", None) or request.headers.get("traceparent", "")
    turn = {}
    if (session_id := turns.session_id_of(request, body.session_id)) is not None:
        rid = uuid.uuid4().hex
        key, worker = await turns.begin(core, caller(request), session_id, rid)
        turn = {"request_id": rid, "session": key, "session_worker": worker}
        extra_meta = {**(extra_meta or {}), "session_id": session_id}
    try:
        return await core.submit(
            body,
            max_tokens,
            owner=caller(request),
            extra_meta=extra_meta,
            traceparent=traceparent,
            route=request.url.path,
            constraint=constraint,
            tools=tools,
            **choice,
            **turn,
        )
    except BaseException:
        if turn:  # not created: the turn that began is over
            await core.sessions.amove(end_turn(turn["session"], turn["request_id"]))
        raise
