"""What a request's output must be (response_format, vLLM's structured_outputs, tools, tool_choice), checked at the
gateway.

Every schema is compiled here (shared/text/grammar.py) before the request is created, so a bad one is a 400 naming
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
from services.gateway.openai.schemas import MAX_PATTERN, StructuredOutputs
from services.gateway.openai.tool_calls import Tool, auto_grammar, call_schema, check_tools, chosen
from shared.wire.events import Constraint
from shared.text.grammar import (
    ANY_OBJECT,
    GrammarError,
    KIND_JSON_SCHEMA,
    KIND_LARK,
    KIND_REGEX,
    check,
    choice_lark,
    client_lark,
)

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


# structured_outputs' constraints: at most one per request (as vLLM)
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# its fields Conveyor does not honour, and the value that is a 400
REFUSED = {"disable_additional_properties": True, "whitespace_pattern": None, "structural_tag": None}


def _checked(kind: str, spec: str, param: str, what: str) -> Constraint:
    try:
        check(kind, spec)
    except GrammarError as e:
        raise _bad(param, f"not a usable {what}: {e}", "invalid_schema") from e
    return Constraint(kind=kind, spec=spec)


def structured_constraint(so, param: str | None = None) -> Constraint | None:
    """The constraint of vLLM's structured_outputs (schemas.StructuredOutputs, or None); raises a 400 naming the bad
    field (param, if given, else structured_outputs.<its field>)."""
    if so is None:
        return None
    for field, refused in REFUSED.items():
        value = getattr(so, field)
        if value is not None and (refused is None or value == refused):
            raise _bad(f"structured_outputs.{field}", "not supported", "unsupported_parameter")
    given = [c for c in CONSTRAINTS if getattr(so, "json_schema" if c == "json" else c) not in (None, False)]
    if len(given) > 1:
        raise _bad(
            "structured_outputs",
            f"only one constraint at a time (got {' and '.join(given)})",
            "unsupported_parameter",
        )
    if not given:
        return None
    param = param or f"structured_outputs.{given[0]}"
    if given[0] == "regex":
        return _checked(KIND_REGEX, so.regex, param, "regular expression")
    if given[0] == "choice":
        return _checked(KIND_LARK, choice_lark(so.choice), param, "choice")
    if given[0] == "grammar":
        try:
            lark = client_lark(so.grammar)
        except GrammarError as e:
            raise _bad(param, str(e), "invalid_grammar") from e
        return _checked(KIND_LARK, lark, param, "grammar")
    if given[0] == "json_object":
        return Constraint(kind=KIND_JSON_SCHEMA, spec=ANY_OBJECT)
    schema = so.json_schema
    if isinstance(schema, str):  # vLLM takes the schema's JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _bad(param, f"not JSON: {e}", "invalid_schema") from e
    return _compiled(schema, param)


def plan_weight(body) -> int:
    """How heavy plan_chat(body) is for the loop (render.HEAVY): a schema or grammar to compile makes it heavy."""
    fmt = getattr(body, "response_format", None)
    heavy = getattr(body, "tools", None) or (fmt is not None and fmt.type == "json_schema") or body.structured_outputs
    return HEAVY if heavy else 0


def _one_constraint(body) -> Constraint | None:
    """response_format's or structured_outputs' constraint; both at once are a 400 naming both."""
    fmt = getattr(body, "response_format", None)
    constraint = response_constraint(fmt)
    structured = structured_constraint(body.structured_outputs)
    if constraint is not None and structured is not None:
        raise _bad(
            "structured_outputs",
            "cannot be combined with response_format json_object or json_schema (one constraint at a time)",
            "unsupported_parameter",
        )
    return constraint or structured


def native_constraint(body) -> Constraint | None:
    """The constraint of a native request's TGI grammar (GenerateRequest.grammar; None without); raises a 400."""
    g = body.grammar
    if g is None:
        return None
    if g.type == "regex" and not (isinstance(g.value, str) and 0 < len(g.value) <= MAX_PATTERN):
        raise _bad("grammar.value", f"type 'regex' needs a pattern of 1..{MAX_PATTERN} characters")
    so = StructuredOutputs(regex=g.value) if g.type == "regex" else StructuredOutputs(json=g.value)
    return _no_eos_conflict(body, structured_constraint(so, "grammar.value"))


def plan_completion(body) -> OutputPlan:
    """The output plan of a completion request (CompletionRequest): its structured_outputs; raises a 400."""
    return OutputPlan(_no_eos_conflict(body, _one_constraint(body)))


def _no_eos_conflict(body, constraint: Constraint | None) -> Constraint | None:
    if constraint is not None:
        # Both would need tokens the grammar forbids: EOS ends a constrained output when it is complete.
        for param, broken in [("ignore_eos", bool(body.ignore_eos)), ("min_tokens", bool(body.min_tokens))]:
            if broken:
                raise _bad(
                    param,
                    "cannot be combined with a constrained output (response_format json, structured_outputs, "
                    "tools unless tool_choice is 'none')",
                    "unsupported_parameter",
                )
    return constraint


def plan_chat(body) -> OutputPlan:
    """The output plan of a chat request (ChatCompletionRequest); raises a 400 naming the bad field."""
    constraint = _one_constraint(body)
    tools = check_tools(body.tools or [])
    mode, usable = chosen(tools, body.tool_choice)
    if mode != "none" and constraint is not None:
        param = "response_format" if body.structured_outputs is None else "structured_outputs"
        raise _bad(param, "cannot be combined with tools unless tool_choice is 'none'", "unsupported_parameter")
    # a named function is called once; "required" and "auto" may call several unless told otherwise
    parallel = not isinstance(body.tool_choice, dict) and body.parallel_tool_calls is not False
    if mode == "forced":
        constraint = Constraint(kind=KIND_JSON_SCHEMA, spec=call_schema(usable, parallel))
    elif mode == "auto":
        constraint = Constraint(kind=KIND_LARK, spec=auto_grammar(usable, parallel))
    return OutputPlan(_no_eos_conflict(body, constraint), tuple(usable), mode)
