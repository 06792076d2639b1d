"""A response's items (its input's, its output's) as the chat turns chat completions takes.

The Responses API sends a conversation as a flat list of items; chat completions as turns. The mapping is the one
OpenAI documents between the two: a message item is a turn of its role (its text parts joined by newlines, as chat
joins them); function_call items are an assistant turn's tool_calls (consecutive ones, and the assistant message
right before them, one turn); a function_call_output item is a tool turn answering its call_id. Items are checked
here one field at a time, so a bad one is a 400 naming its path (`input[2].call_id`).
"""

from __future__ import annotations

import uuid
from typing import Any

from services.gateway.edge.errors import InvalidRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
MAX_TEXT = 1_000_000  # as a chat message's content


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, code)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(param, "must be a string")
    if len(value) > MAX_TEXT:
        raise _bad(param, f"at most {MAX_TEXT} characters")
    return value


def _known(item: dict, allowed: set[str], where: str) -> None:
    unknown = set(item) - allowed
    if unknown:
        raise _bad(where, f"unknown field(s) {sorted(unknown)}", "unknown_parameter")


def _message(item: dict, where: str) -> dict:
    _known(item, {"type", "role", "content", "id", "status"}, where)
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {role!r})")
    content = item.get("content")
    if isinstance(content, str):
        texts = [_text(content, f"{where}.content")]
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{at}.type", f"only text parts ({', '.join(TEXT_PARTS)}) are supported (got {kind!r})")
            _known(part, {"type", "text", "annotations", "logprobs"}, at)
            texts.append(_text(part.get("text"), f"{at}.text"))
    else:
        raise _bad(f"{where}.content", "must be a string or a list of text parts")
    part_type = "output_text" if role == "assistant" else "input_text"
    parts = [{"type": part_type, "text": t, **({"annotations": []} if role == "assistant" else {})} for t in texts]
    return {
        "id": item.get("id") or new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": parts,
    }


def _call(item: dict, where: str) -> dict:
    _known(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
    return {
        "id": item.get("id") or new_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": _text(item.get("call_id"), f"{where}.call_id"),
        "name": _text(item.get("name"), f"{where}.name"),
        "arguments": _text(item.get("arguments"), f"{where}.arguments"),
    }


def _call_output(item: dict, where: str) -> dict:
    _known(item, {"type", "call_id", "output", "id", "status"}, where)
    return {
        "id": item.get("id") or new_id("fco"),
        "type": "function_call_output",
        "status": "completed",
        "call_id": _text(item.get("call_id"), f"{where}.call_id"),
        "output": _text(item.get("output"), f"{where}.output"),
    }


KINDS = {"message": _message, "function_call": _call, "function_call_output": _call_output}


def input_items(raw: str | list[dict]) -> list[dict]:
    """The request's input as stored items (each with an id, as GET .../input_items lists them)."""
    if isinstance(raw, str):
        return [_message({"role": "user", "content": raw}, "input")]
    if not raw:
        raise _bad("input", "must hold at least one item")
    out = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")  # a message may leave its type out (the SDK's EasyInputMessage)
        if not isinstance(kind, str) or kind not in KINDS:
            raise _bad(f"input[{i}].type", f"must be one of {', '.join(KINDS)} (got {kind!r})", "unsupported_value")
        out.append(KINDS[kind](item, f"input[{i}]"))
    return out


def chat_turns(items: list[dict]) -> list[dict]:
    """Stored items (input_items' or a response's output) as chat messages (ChatCompletionRequest.messages)."""
    turns: list[dict] = []
    for item in items:
        if item["type"] == "message":
            text = "\n".join(p["text"] for p in item["content"])
            turns.append({"role": item["role"], "content": text})
        elif item["type"] == "function_call_output":
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return turns
