"""What a chat request's output must be (response_format, tools, tool_choice), checked at the gateway.

Every schema is compiled here (shared/grammar.py) before the request is created, so a bad one is a 400 naming
its field and never reaches a worker. That is up to 128 tools' schemas (~1 s for a 1 MB body): the endpoint runs
plan_chat off the event loop (render.off_loop, plan_weight), and a schema found valid before is not compiled
again (grammar.check: agents send the same tools every turn). The result, an OutputPlan, says what the worker
enforces (a Constraint on Sampling), what the tokenizer renders into the prompt (the tools) and how the answer is
shaped (text or tool calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from services.gateway.edge.errors import InvalidRequest
from services.gateway.text.render import HEAVY
from services.gateway.openai.tool_calls import Tool, auto_grammar, call_schema, check_tools, chosen
from shared.events import Constraint
from shared.grammar import ANY_OBJECT, GrammarError, KIND_JSON_SCHEMA, KIND_LARK, check

FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class OutputPlan:
    constraint: Constraint | None = None  # enforced by the worker, token by token
    tools: tuple[Tool, ...] = ()  # the tools a call may use (rendered into the prompt unless mode is none)
    tool_mode: str = "none"  # none: text | auto: text or calls, parsed at the end | forced: calls, constrained

    @cached_property  # read by every choice's intake, on the loop: 1 MB of tools is ~10 ms a json.dumps
    def tools_json(self) -> str:
        """The tool definitions for the tokenizer's prompt ("" when the model is not to call any)."""
        return json.dumps([t.definition for t in self.tools]) if self.tool_mode != "none" else ""


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, code)


def _compiled(schema, param: str) -> Constraint:
    spec = json.dumps(schema)
    try:
        check(KIND_JSON_SCHEMA, spec)
    except GrammarError as e:
        raise _bad(param, f"not a usable JSON Schema: {e}", "invalid_schema") from e
    return Constraint(kind=KIND_JSON_SCHEMA, spec=spec)


def response_constraint(response_format) -> Constraint | None:
    """The constraint of response_format (None for text); raises a 400 naming the bad field."""
    if response_format is None or response_format.type == "text":
        return None
    extra = response_format.model_extra or {}
    if response_format.type == "json_object":
        if extra:
            raise _bad("response_format", f"unknown field(s) {sorted(extra)} for type 'json_object'")
        return Constraint(kind=KIND_JSON_SCHEMA, spec=ANY_OBJECT)
    if response_format.type != "json_schema":
        raise _bad("response_format.type", f"must be one of {', '.join(FORMATS)} (got {response_format.type!r})")
    unknown = set(extra) - {"json_schema"}
    spec = extra.get("json_schema")
    if unknown or not isinstance(spec, dict):
        raise _bad(
            "response_format.json_schema",
            "type 'json_schema' needs {'json_schema': {'name': ..., 'schema': {...}}} and nothing else",
        )
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise _bad("response_format.json_schema", f"unknown field(s) {sorted(unknown)}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("response_format.json_schema.name", "a non-empty string is required")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "must be a JSON Schema object")
    return _compiled(schema, "response_format.json_schema.schema")


def plan_weight(body) -> int:
    """How heavy plan_chat(body) is for the loop (render.HEAVY): a schema to compile makes it heavy."""
    fmt = body.response_format
    return HEAVY if body.tools or (fmt is not None and fmt.type == "json_schema") else 0


def plan_chat(body) -> OutputPlan:
    """The output plan of a chat request (ChatCompletionRequest); raises a 400 naming the bad field."""
    constraint = response_constraint(body.response_format)
    tools = check_tools(body.tools or [])
    mode, usable = chosen(tools, body.tool_choice)
    if mode != "none" and constraint is not None:
        raise _bad(
            "response_format", "cannot be combined with tools unless tool_choice is 'none'", "unsupported_parameter"
        )
    # a named function is called once; "required" and "auto" may call several unless told otherwise
    parallel = not isinstance(body.tool_choice, dict) and body.parallel_tool_calls is not False
    if mode == "forced":
        constraint = Constraint(kind=KIND_JSON_SCHEMA, spec=call_schema(usable, parallel))
    elif mode == "auto":
        constraint = Constraint(kind=KIND_LARK, spec=auto_grammar(usable, parallel))
    if constraint is not None:
        # Both would need tokens the grammar forbids: EOS ends a constrained output when it is complete.
        for param, broken in [("ignore_eos", bool(body.ignore_eos)), ("min_tokens", bool(body.min_tokens))]:
            if broken:
                raise _bad(
                    param,
                    "cannot be combined with response_format json or tools (unless tool_choice is 'none')",
                    "unsupported_parameter",
                )
    return OutputPlan(constraint, tuple(usable), mode)
