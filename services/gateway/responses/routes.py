"""The OpenAI Responses API: POST /v1/responses, and its stored responses (GET, input_items, DELETE).

A Responses request is the chat completions request it means (responses.chat_body) and goes the chat path from
there: the same plan of its output (openai.structured_output.plan_chat: tools, json_schema), the same native
GenerateRequest (openai.native_request), session.intake.accept_choices and session.drive; only the answer's shape
is the Responses API's (responses.output, responses.stream). store=true (the default) keeps it in Redis for
responses_ttl_s (responses.store), owned by the caller's API key: another key gets 404, as for a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import redis
from fastapi import APIRouter, Query, Request

from services.gateway.conversation import turns
from services.gateway.edge.auth import caller
from services.gateway.edge.deps import Core
from services.gateway.edge.errors import InvalidRequest, NotFound, Unavailable
from services.gateway.edge.sse import SseResponse
from services.gateway.edge.openapi_doc import GENERATION_ERRORS, error_responses, sse_or_json
from services.gateway.openai.native_request import chat_messages, native_request
from services.gateway.openai.structured_output import plan_chat, plan_weight
from services.gateway.responses import background, store
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
from services.gateway.responses.stream import replay, start_stream
from services.gateway.session.drive import collect_choices
from services.gateway.session.intake import accept_choices
from services.gateway.text.render import json_response, off_loop

if TYPE_CHECKING:
    from services.gateway.openai.structured_output import OutputPlan
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices

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


@dataclass
class Accepted:
    """A request created, and what its answer is made with."""

    core: GatewayCore
    body: ResponsesRequest
    owner: str
    choices: Choices
    plan: OutputPlan
    items: list[dict]  # its input, as stored
    before: list[dict]  # the previous response's conversation (chat turns)
    envelope: Envelope
    session_id: str  # the session it is a turn of ("" none)

    def stored(self, response: dict) -> store.Stored:
        conversation = self.before + chat_turns(self.items) + chat_turns(response["output"])
        return store.Stored(
            response,
            self.items,
            conversation,
            reply_to=self.choices.primary.reply_to,
            session_id=self.session_id,
            gateway=self.core.id,
            body=self.body.model_dump(mode="json", exclude_none=True) if self.body.background else None,
        )

    async def finished(self, response: dict) -> None:
        """Store the final response (store=true) before the client hears of it."""
        if not self.body.store:
            return
        try:
            await store.put(self.core, self.owner, self.stored(response))
        except redis.RedisError as e:  # the client was promised a stored response: it hears that it is not
            raise Unavailable(
                f"store: the response was generated but could not be stored ({e!r})", "store", "store_failed"
            ) from e


async def _accept(core: GatewayCore, request: Request, body: ResponsesRequest) -> Accepted:
    _check(core, body)
    owner = caller(request)
    items = input_items(body.input)
    before, session = [], turns.session_id_of(request, None)
    if body.previous_response_id:
        previous = await store.get(core, owner, body.previous_response_id, "previous_response_id")
        if previous.response["status"] in store.RUNNING:  # its output is not known yet: nothing to continue from
            raise InvalidRequest(
                f"previous_response_id: the response {body.previous_response_id!r} is still "
                f"{previous.response['status']}; continue it once it has ended",
                "previous_response_id",
                "response_running",
            )
        before, session = previous.turns, session or previous.session_id  # its session goes on, with its KV
    try:
        chat = chat_request(body, before + chat_turns(items), session)
        plan = await off_loop(lambda: plan_chat(chat), plan_weight(chat))  # its schemas compiled off the loop
        native = native_request(chat, body.max_output_tokens, None, messages=chat_messages(chat))
        meta = {"api": "openai.responses", "user": body.user}
        if body.background:  # its request outlives its gateway: another takes the response over (responses.takeover)
            meta["detached"] = True
        choices = await accept_choices(
            core, request, native, 1, None, meta, constraint=plan.constraint, tools=plan.tools_json
        )
    except InvalidRequest as e:
        raise renamed(e) from e
    envelope = Envelope(f"resp_{choices.primary.request_id}", core.model_name, _echoed(body), bool(body.background))
    return Accepted(core, body, owner, choices, plan, items, before, envelope, session or "")


async def _in_background(core: GatewayCore, request: Request, job: Accepted):
    """Store it queued, start its task, answer: the queued response, or (stream) its events as they are logged."""
    primary, envelope = job.choices.primary, job.envelope
    queued = envelope.response("queued", [])
    try:
        await store.index_driving(core, job.owner, envelope.id)  # first: an entry without its record is dropped
        await store.put(core, job.owner, job.stored(queued))
    except BaseException:
        core.abandon(primary, "store_failed")  # nobody would ever see it: do not run it
        raise
    out = OutputBuilder(job.plan)
    try:
        await background.start(
            background.Job(core, request, primary, envelope, out, job.stored, job.owner, bool(job.body.stream), renamed)
        )
    except BaseException:
        core.abandon(primary, "store_failed")
        raise
    if job.body.stream:
        headers = {"X-Request-Id": primary.request_id}
        return SseResponse(replay(core, job.owner, envelope.id, -1), core.s.sse_write_timeout_s, headers=headers)
    return queued


@router.post("/v1/responses", responses={**sse_or_json(ResponseObject, "the response"), **GENERATION_ERRORS})
async def create_response(body: ResponsesRequest, request: Request, core: Core):
    if body.background and body.store is False:
        raise InvalidRequest("store: a background response is stored (store must be true)", "store", "invalid_value")
    job = await _accept(core, request, body)
    primary, envelope = job.choices.primary, job.envelope
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if body.background:
        return await _in_background(core, request, job)
    try:  # the prompt refused (too long, max_output_tokens beyond the context) names the chat field: rename it
        if body.stream:
            out = OutputBuilder(job.plan)
            return await start_stream(request, core, job.choices, envelope, out, job.finished, headers)
        (native_body,) = await collect_choices(core, job.choices, request, with_logprobs=False)
    except InvalidRequest as e:
        raise renamed(e) from e
    out = OutputBuilder(job.plan)
    out.feed(native_body["text"])
    status, reason, _events = out.finish(native_body["finish_reason"])
    response = envelope.response(status, out.output, native_body["usage"], reason)
    await job.finished(response)
    return await json_response(lambda: response, len(native_body["token_ids"]), headers)


@router.get(
    "/v1/responses/{response_id}",
    responses={**sse_or_json(ResponseObject, "the response, or its events"), **error_responses(400, 401, 404)},
)
async def get_response(
    response_id: str,
    request: Request,
    core: Core,
    stream: bool = Query(False, description="a background response created with stream=true: its events"),
    starting_after: int = Query(-1, ge=-1, description="with stream: the events after this sequence_number"),
):
    owner = caller(request)
    stored = await store.get(core, owner, response_id)
    if not stream:
        return stored.response
    if not stored.response.get("background") or not await store.has_events(core, owner, response_id):
        raise InvalidRequest(
            "stream: only a background response created with stream=true can be streamed again", "stream"
        )
    return SseResponse(replay(core, owner, response_id, starting_after), core.s.sse_write_timeout_s)


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


@router.post(
    "/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=error_responses(400, 401, 404)
)
async def cancel_response(response_id: str, request: Request, core: Core) -> dict:
    """Cancel a background response: settled cancelled in its record first (its task's later writes are then
    no-ops, whatever gateway runs it), then its work stopped. One that has ended already is answered as it is."""
    owner = caller(request)
    stored = await store.get(core, owner, response_id)
    if not stored.response.get("background"):
        raise InvalidRequest(
            "response_id: only a background response can be cancelled", "response_id", "not_background"
        )
    if stored.response["status"] in store.RUNNING:
        cancelled = stored.with_response(stored.response | {"status": "cancelled"})
        if await store.update_running(core, owner, cancelled):
            await core.cancel(stored.request_id, "client_cancel", stored.reply_to)
    return (await store.get(core, owner, response_id)).response


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(401, 404))
async def delete_response(response_id: str, request: Request, core: Core) -> dict:
    """Delete it; a background response still running is cancelled too (nobody could read its answer)."""
    owner = caller(request)
    stored = await store.get(core, owner, response_id)
    await store.delete(core, owner, response_id)
    if stored.response.get("background") and stored.response["status"] in store.RUNNING:
        await core.cancel(stored.request_id, "client_cancel", stored.reply_to)
    return {"id": response_id, "object": "response", "deleted": True}
