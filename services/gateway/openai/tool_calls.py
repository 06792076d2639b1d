"""Tool calls: the request's tools checked, the grammar of a valid call, and the model's calls shaped as OpenAI's.

With tool_choice "required" or a named function the output is constrained (shared/text/grammar.py) to a JSON array
of calls, `[{"name": "<one of the tools>", "arguments": <that function's parameters>}, ...]` (one call when
parallel_tool_calls is false or a function is named), written compactly with ", " and ": " as separators and the
keys in that order. CallParser reads exactly that text as it streams and cuts it into OpenAI's tool-call deltas
(id, type and name first, then argument fragments), so the streamed fragments concatenate to the arguments of the
non-stream answer. With "auto" the output is constrained to either text that does not start with "[" or that same
array (auto_grammar).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.edge.errors import InvalidRequest
from shared.text.grammar import JSON_OPTIONS, GrammarError, KIND_JSON_SCHEMA, check

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
MAX_TOOLS = 128  # OpenAI's limit on the tools of one request


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, code)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # its JSON Schema (an object schema)
    definition: dict  # as the client gave it (rendered into the prompt)


def check_tools(tools: list[dict]) -> list[Tool]:
    """The request's function tools; raises a 400 naming the first bad field."""
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools (got {len(tools)})")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _bad(where, "only {'type': 'function', 'function': {...}} tools are supported")
        fn = t["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"{where}.function", f"unknown field(s) {sorted(unknown)}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
        if name in seen:
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters", "must be a JSON Schema of type 'object'")
        params = {**params, "type": "object"}
        try:
            check(KIND_JSON_SCHEMA, json.dumps(params))
        except GrammarError as e:
            raise _bad(f"{where}.function.parameters", f"not a usable JSON Schema: {e}", "invalid_schema") from e
        out.append(Tool(name, params, {"type": "function", "function": fn}))
    return out


def chosen(tools: list[Tool], tool_choice: Any) -> tuple[str, list[Tool]]:
    """(mode, the tools a call may use): mode is none | auto | forced; raises a 400 for a bad tool_choice."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise _bad("tool_choice", f"{tool_choice!r} needs tools")
        return ("forced" if tool_choice == "required" else tool_choice), tools
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        name = tool_choice["function"].get("name")
        named = [t for t in tools if t.name == name]
        if not named:
            raise _bad("tool_choice.function.name", f"{name!r} is not one of the tools")
        return "forced", named
    raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def _scoped(params: dict, prefix: str, defs: dict) -> dict:
    """params with its $defs moved into the call schema's root `defs` under prefix, and its refs rewritten (a
    '#/...' ref means the root of the document it is in, which is no longer this schema)."""
    params = copy.deepcopy(params)
    for key in ("$defs", "definitions"):
        for name, sub in (params.pop(key, None) or {}).items():
            defs[f"{prefix}{name}"] = sub

    def rewrite(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    raise _bad("tools", "a parameters schema may not refer to its own root ('$ref': '#')")
                for key in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(key):
                        node["$ref"] = f"#/$defs/{prefix}{ref[len(key) :]}"
            for v in node.values():
                rewrite(v)
        elif isinstance(node, list):
            for v in node:
                rewrite(v)

    rewrite(params)
    for name in [n for n in defs if n.startswith(prefix)]:
        rewrite(defs[name])
    return params


def call_schema(tools: list[Tool], parallel: bool) -> str:
    """The JSON Schema of the output when a call is forced: an array of 1 (or, parallel, more) calls."""
    return json.dumps(_calls_schema(tools, parallel))


def auto_grammar(tools: list[Tool], parallel: bool) -> str:
    """The Lark grammar of an "auto" answer: text that does not start with "[", or an array of valid calls (the
    JSON written as in a forced call)."""
    calls = {**_calls_schema(tools, parallel), "x-guidance": JSON_OPTIONS}
    return f"start: calls | text\ncalls: %json {json.dumps(calls)}\ntext: /[^\\[][\\s\\S]*/\n"


def _calls_schema(tools: list[Tool], parallel: bool) -> dict:
    defs: dict = {}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _scoped(t.parameters, f"f{i}_", defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    schema: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_HEAD, _SEP = '{"name": "', '", "arguments": '


@dataclass
class CallParser:
    """Reads the constrained calls text (see the module doc) as it arrives: feed() -> OpenAI tool_calls deltas."""

    calls: list[Call] = field(default_factory=list)
    _buf: str = ""
    _state: str = "open"  # open | head | name | sep | args | close | next | done
    _depth: int = 0
    _in_str: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        deltas: list[dict] = []
        while self._buf and self._state != "done":
            if self._state == "args":
                self._args(deltas)
                continue
            literal = {"open": "[", "head": _HEAD, "sep": _SEP, "close": "}"}.get(self._state)
            if literal is not None:
                if len(self._buf) < len(literal):
                    break
                if not self._buf.startswith(literal):
                    raise ValueError(f"expected {literal!r} in the tool calls, got {self._buf[:20]!r}")
                self._buf = self._buf[len(literal) :]
                self._state = {"open": "head", "head": "name", "sep": "args", "close": "next"}[self._state]
            elif self._state == "name":
                end = self._buf.find('"')
                if end < 0:
                    break
                call = Call(new_call_id(), self._buf[:end])
                self.calls.append(call)
                deltas.append(
                    {
                        "index": len(self.calls) - 1,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                self._buf, self._state = self._buf[end:], "sep"  # the closing quote starts _SEP
            elif self._state == "next":
                if self._buf.startswith("]"):
                    self._buf, self._state = self._buf[1:], "done"
                elif len(self._buf) < 2:
                    break
                elif self._buf.startswith(", "):
                    self._buf, self._state = self._buf[2:], "head"
                else:
                    raise ValueError(f"expected ', ' or ']' after a tool call, got {self._buf[:20]!r}")
        return deltas

    def _args(self, deltas: list[dict]) -> None:
        """Take the arguments' characters up to the end of their JSON value (or of the buffer)."""
        i = 0
        for i, ch in enumerate(self._buf, 1):
            if self._in_str:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_str = False
                continue
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "close"
                    break
        piece, self._buf = self._buf[:i], self._buf[i:]
        self.calls[-1].arguments += piece
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

    @property
    def complete(self) -> bool:
        return self._state == "done"


def turn_text(i: int, role: str, text: str | None, tool_calls: list[dict] | None) -> str:
    """A chat turn's text for the template: an assistant's earlier calls are written as the model is asked to
    write them (a JSON array of {name, arguments}); raises a 400 naming messages[i] when they are malformed."""
    if text is None and not tool_calls:
        raise _bad(f"messages[{i}].content", "may be null only in an assistant turn with tool_calls")
    if not tool_calls:
        return text or ""
    if role != "assistant":
        raise _bad(f"messages[{i}].tool_calls", "only assistant turns carry tool calls")
    calls = []
    for j, c in enumerate(tool_calls):
        fn = c.get("function") if c.get("type", "function") == "function" else None
        try:
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise TypeError("no function name")
            calls.append({"name": fn["name"], "arguments": json.loads(fn.get("arguments") or "{}")})
        except (TypeError, ValueError) as e:
            raise _bad(
                f"messages[{i}].tool_calls[{j}]",
                "must be {'id', 'type': 'function', 'function': {'name', 'arguments': a JSON string}}",
            ) from e
    written = json.dumps(calls, ensure_ascii=False)
    return f"{text}\n{written}" if text else written
