"""Constrained output: the one place a constraint becomes a grammar (llguidance), for the gateway's check of a
client's schema and the worker's per-sequence matchers. No torch here: the gateway imports it.

The JSON is compact and single-spaced (", " and ": ", no other whitespace): with any whitespace allowed, a small
model can fill its whole budget with newlines and never close the object.
"""

from __future__ import annotations

import json

import llguidance

KIND_JSON_SCHEMA = "json_schema"  # the output is one JSON value valid against a JSON Schema (spec: its JSON text)
KIND_LARK = "lark"  # the output is a sentence of an llguidance Lark grammar (spec: its text); built by Conveyor only
KINDS = (KIND_JSON_SCHEMA, KIND_LARK)
ANY_OBJECT = json.dumps({"type": "object"})  # response_format json_object: any JSON object
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; its message names what is wrong in the schema."""


def grammar_for(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint, checked; raises GrammarError."""
    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == KIND_LARK:
        return _checked(llguidance.LLMatcher.grammar_from_lark(spec))
    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"the schema is not JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("the schema must be a JSON object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(str(e)) from e
    return _checked(grammar)


def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar
