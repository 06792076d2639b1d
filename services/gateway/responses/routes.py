"""The OpenAI Responses API: POST /v1/responses, and its stored responses (GET, input_items, DELETE).

A Responses request is the chat completions request it means (responses.chat_body) and goes the chat path from
there: the same plan of its output (openai.structured_output.plan_chat: tools, json_schema), the same native
GenerateRequest (openai.native_request), session.intake.accept_choices and session.drive; only the answer's shape
is the Responses API's (responses.output, responses.stream). store=true (the default) keeps it in Redis for
responses_ttl_s (responses.store), owned by the caller's API key: another key gets 404, as for a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import redis
from fastapi import APIRouter, Query, Request

from services.gateway.edge.auth import caller
from services.gateway.edge.deps import Core
from services.gateway.edge.errors import InvalidRequest, NotFound, Unavailable
from services.gateway.edge.openapi_doc import GENERATION_ERRORS, error_responses, sse_or_json
from services.gateway.openai.native_request import chat_messages, native_request
from services.gateway.openai.structured_output import plan_chat, plan_weight
from services.gateway.responses import store
from services.gateway.responses.chat_body import chat_request, renamed
from services.gateway.responses.items import chat_turns, input_items
from services.gateway.responses.output import ECHOED, Envelope, OutputBuilder
from services.gateway.responses.schemas import (
    REFUSED,
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from services.gateway.responses.stream import start_stream
from services.gateway.session.drive import collect_choices
from services.gateway.session.intake import accept_choices
from services.gateway.text.render import json_response, off_loop

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

router = APIRouter(tags=["Responses"])

MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key length, value length
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
# What the Response object says for a field the request left out (OpenAI's defaults).
DEFAULTS = {
    "metadata": {},
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "truncation": "disabled",
}


def _check(core: GatewayCore, body: ResponsesRequest) -> None:
    if body.model != core.model_name:
        raise NotFound(
            f"the model '{body.model}' does not exist; this server serves '{core.model_name}'",
            "model",
            "model_not_found",
        )
    for name, harmless, why in REFUSED:
        if getattr(body, name) not in harmless:
            raise InvalidRequest(f"{name}: {why}", name, "unsupported_parameter")
    meta = body.metadata or {}
    if len(meta) > MAX_METADATA or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()
    ):
        raise InvalidRequest(
            f"metadata: at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} characters and values of "
            f"at most {MAX_METADATA_VALUE}",
            "metadata",
            "invalid_value",
        )


def _echoed(body: ResponsesRequest) -> dict:
    given = body.model_dump(include=set(ECHOED))
    return {k: DEFAULTS.get(k) if v is None else v for k, v in given.items()}


@router.post("/v1/responses", responses={**sse_or_json(ResponseObject, "the response"), **GENERATION_ERRORS})
async def create_response(body: ResponsesRequest, request: Request, core: Core):
    _check(core, body)
    owner = caller(request)
    items = input_items(body.input)
    before = (
        (await store.get(core, owner, body.previous_response_id, "previous_response_id")).turns
        if (body.previous_response_id)
        else []
    )
    try:
        chat = chat_request(body, before + chat_turns(items))
        plan = await off_loop(lambda: plan_chat(chat), plan_weight(chat))  # its schemas compiled off the loop
        native = native_request(chat, body.max_output_tokens, None, messages=chat_messages(chat))
        meta = {"api": "openai.responses", "user": body.user}
        choices = await accept_choices(
            core, request, native, 1, None, meta, constraint=plan.constraint, tools=plan.tools_json
        )
    except InvalidRequest as e:
        raise renamed(e) from e
    primary = choices.primary
    envelope = Envelope(f"resp_{primary.request_id}", core.model_name, _echoed(body))
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}

    async def finished(response: dict) -> None:
        if not body.store:
            return
        turns = before + chat_turns(items) + chat_turns(response["output"])
        try:
            await store.put(core, owner, store.Stored(response, items, turns))
        except redis.RedisError as e:  # the client was promised a stored response: it hears that it is not
            raise Unavailable(
                f"store: the response was generated but could not be stored ({e!r})", "store", "store_failed"
            ) from e

    if native.stream:
        return await start_stream(request, core, choices, envelope, OutputBuilder(plan), finished, headers)
    (native_body,) = await collect_choices(core, choices, request, with_logprobs=False)
    out = OutputBuilder(plan)
    out.feed(native_body["text"])
    status, reason, _events = out.finish(native_body["finish_reason"])
    response = envelope.response(status, out.output, native_body["usage"], reason)
    await finished(response)
    return await json_response(lambda: response, len(native_body["token_ids"]), headers)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=error_responses(401, 404))
async def get_response(response_id: str, request: Request, core: Core) -> dict:
    return (await store.get(core, caller(request), response_id)).response


@router.get(
    "/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=error_responses(400, 401, 404)
)
async def list_input_items(
    response_id: str,
    request: Request,
    core: Core,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query("desc"),
    after: str | None = Query(None, description="the id of the item the page starts after"),
) -> dict:
    """The response's input items (its own: a previous response's are listed under its id), a page at a time."""
    items = (await store.get(core, caller(request), response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"after: no input item {after!r} in this response", "after", "invalid_value")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(401, 404))
async def delete_response(response_id: str, request: Request, core: Core) -> dict:
    await store.delete(core, caller(request), response_id)
    return {"id": response_id, "object": "response", "deleted": True}
