"""A Responses request as the chat completions body it means: the same turns, tools and output format, so that it
goes the chat path from there (openai.structured_output.plan_chat, openai.native_request), and nothing about the
answer can differ from chat's but its shape.

The mapping: instructions are a system turn first; a previous response's conversation comes next, then the input's
items (responses.items); a flat function tool `{type, name, description, parameters, strict}` is chat's
`{type, function: {...}}`; tool_choice `{type: function, name}` is chat's `{type, function: {name}}`; text.format
`{type: json_schema, name, schema, strict}` is response_format `{type: json_schema, json_schema: {...}}`. An error the
chat path raises names the chat field: renamed() names the Responses field instead.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from services.gateway.edge.errors import InvalidRequest
from services.gateway.openai.schemas import ChatCompletionRequest
from services.gateway.responses.schemas import ResponsesRequest

TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}
SCHEMA_FIELDS = {"name", "description", "schema", "strict"}
# chat's parameter names -> the Responses API's (first match wins: the longest prefixes first)
RENAMED = (
    (re.compile(r"^response_format\.json_schema\.(\w+)"), r"text.format.\1"),
    (
        re.compile(r"^response_format(\.json_schema|\.type)?"),
        lambda m: "text.format" + (".type" if m[1] == ".type" else ""),
    ),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
)


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, code)


def renamed(e: InvalidRequest) -> InvalidRequest:
    """e with the chat field it names renamed to the Responses field the client sent."""
    if e.param is None:
        return e
    for pattern, to in RENAMED:
        if pattern.match(e.param):
            param = pattern.sub(to, e.param, count=1)
            message = e.message.replace(e.param, param)
            return InvalidRequest(message, param, e.code, e.extra or None, e.headers)
    return e


def _tool(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise _bad(f"{where}.type", f"only function tools are supported (got {kind!r})", "unsupported_value")
    unknown = set(tool) - TOOL_FIELDS
    if unknown:
        raise _bad(where, f"unknown field(s) {sorted(unknown)}", "unknown_parameter")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice  # none | auto | required: plan_chat checks the word
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def _response_format(text: dict | None) -> dict | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise _bad("text", f"unknown field(s) {sorted(unknown)}", "unknown_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity", "only 'medium' is supported", "unsupported_value")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object {type: text | json_object | json_schema}")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object, or a type plan_chat refuses by name
    unknown = set(fmt) - SCHEMA_FIELDS - {"type"}
    if unknown:
        raise _bad("text.format", f"unknown field(s) {sorted(unknown)}", "unknown_parameter")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(body: ResponsesRequest, turns: list[dict], session_id: str | None = None) -> ChatCompletionRequest:
    """The chat body of the request, whose conversation is `turns` (chat messages, instructions not included), a
    turn of session_id if given."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {"model": body.model, "messages": system + turns, "stream": bool(body.stream)}
    if session_id:
        chat["session_id"] = session_id
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(body.tools)]
    if (choice := _tool_choice(body.tool_choice)) is not None:
        chat["tool_choice"] = choice
    if (fmt := _response_format(body.text)) is not None:
        chat["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:  # checked item by item before: only a limit chat's schema adds
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise renamed(_bad(where, err["msg"], err["type"])) from e
