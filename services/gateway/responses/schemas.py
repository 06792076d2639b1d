"""The Responses API's request body (POST /v1/responses), validated strictly like the chat body.

Every field the official client may send is known: those Conveyor honours are typed here, those it cannot honour
(REFUSED) are accepted by the schema only to be refused with a 400 naming them (responses.routes), never silently
ignored. Input items, tools and text.format are free-form here and checked field by field when they are turned into
a chat body (responses.items, responses.routes), so that each error names the item's own path (`input[2].call_id`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.session.request import Shallow

STRICT = ConfigDict(strict=True, extra="forbid")

# Fields of the API Conveyor does not honour: (field, when it is harmless, why it is refused). A value that asks
# for nothing (null, an empty list, OpenAI's defaults) passes: clients send those without meaning anything.
REFUSED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("reasoning", (None,), "not supported (the served model does not reason in a separate channel)"),
    ("include", (None, []), "not supported (there are no extra output fields to include)"),
    ("prompt", (None,), "not supported (no stored prompt templates)"),
    ("conversation", (None,), "not supported (use previous_response_id)"),
    ("top_logprobs", (None, 0), "not supported"),
    ("max_tool_calls", (None,), "not supported"),
    ("service_tier", (None, "auto", "default"), "only 'auto' or 'default' is supported"),
    ("stream_options", (None,), "not supported"),
    ("prompt_cache_key", (None,), "not supported (prefix caching is automatic)"),
    ("safety_identifier", (None,), "not supported"),
    ("truncation", (None, "disabled"), "only 'disabled' is supported (a prompt too long is a 400)"),
)


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str = Field(..., min_length=1, max_length=256, description="must be the served model (GET /v1/models)")
    input: str | Annotated[list[dict[str, Any]], Shallow] = Field(
        ...,
        description="a user message's text, or a list of items: messages (text parts), function_call and "
        "function_call_output items",
    )
    instructions: str | None = Field(None, max_length=1_000_000, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="most new tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = Field(True, description="keep the response (GET /v1/responses/{id}, previous_response_id)")
    previous_response_id: str | None = Field(
        None, min_length=1, max_length=128, description="a stored response whose input and output come first"
    )
    metadata: dict[str, str] | None = Field(None, description="up to 16 pairs, returned with the response")
    user: str | None = Field(None, max_length=256, description="end-user id, recorded with the request")
    tools: Annotated[list[dict[str, Any]], Shallow] | None = Field(
        None, description="function tools: {type: function, name, description, parameters, strict}"
    )
    tool_choice: str | Annotated[dict[str, Any], Shallow] | None = Field(
        None, description="none | auto | required | {type: function, name}"
    )
    parallel_tool_calls: bool | None = None
    text: Annotated[dict[str, Any], Shallow] | None = Field(
        None, description="{format: {type: text | json_object | json_schema (name, schema, strict)}}"
    )
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = Field(
        None, description="answer at once (status queued) and go on detached from the client; needs store"
    )
    # refused unless they ask for nothing (REFUSED)
    reasoning: Annotated[dict[str, Any], Shallow] | None = None
    include: list[str] | None = None
    prompt: Annotated[dict[str, Any], Shallow] | None = None
    conversation: str | Annotated[dict[str, Any], Shallow] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = Field(None, max_length=64)
    stream_options: Annotated[dict[str, Any], Shallow] | None = None
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=256)


# ---- answers (documented; the handlers build plain dicts of the same shape) ----


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(description="resp_<the request id>")
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]] = Field(description="message items (output_text parts) and function_call items")
    usage: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]
