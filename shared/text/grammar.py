"""Constrained output: the one place a constraint becomes a grammar (llguidance), for the gateway's check of a
client's schema and the worker's per-sequence matchers. No torch here: the gateway imports it.

The JSON is compact and single-spaced (", " and ": ", no other whitespace): with any whitespace allowed, a small
model can fill its whole budget with newlines and never close the object.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

KIND_JSON_SCHEMA = "json_schema"  # the output is one JSON value valid against a JSON Schema (spec: its JSON text)
KIND_LARK = "lark"  # the output is a sentence of an llguidance Lark grammar (spec: its text)
KIND_REGEX = "regex"  # the output matches a regular expression whole (spec: the pattern, Rust regex syntax)
KINDS = (KIND_JSON_SCHEMA, KIND_LARK, KIND_REGEX)
ANY_OBJECT = json.dumps({"type": "object"})  # response_format json_object: any JSON object
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHECKED_MAX = 4096  # digests of specs known valid (check): 16 bytes each


class GrammarError(ValueError):
    """A constraint that cannot be compiled; its message names what is wrong in the schema."""


def grammar_for(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint, checked; raises GrammarError."""
    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == KIND_LARK:
        return _checked(llguidance.LLMatcher.grammar_from_lark(spec))
    if kind == KIND_REGEX:
        return _checked(llguidance.LLMatcher.grammar_from_regex(spec))
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


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly the given strings (JSON string literals are Lark's)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def client_lark(text: str) -> str:
    """A client's grammar as Lark: llguidance's Lark as it is, a GBNF (llama.cpp / xgrammar EBNF, `root ::= ...`)
    converted; raises GrammarError."""
    try:
        return any_to_lark(text)
    except Exception as e:  # GbnfToLarkError, or a plain Exception for an unknown rule
        raise GrammarError(f"neither a Lark grammar (start: ...) nor a GBNF one (root ::= ...): {e}") from e


def _checked(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


_checked_specs: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
_checked_lock = threading.Lock()  # check() runs in several threads (the gateway's render threads)


def check(kind: str, spec: str) -> None:
    """Raise GrammarError unless the constraint compiles; one found valid before is not compiled again (the
    digests of the last CHECKED_MAX valid specs are kept: a client sends the same tools with every turn)."""
    key = hashlib.blake2b(f"{kind}\0{spec}".encode(), digest_size=16).digest()
    with _checked_lock:
        if key in _checked_specs:
            _checked_specs.move_to_end(key)
            return
    grammar_for(kind, spec)
    with _checked_lock:
        _checked_specs[key] = None
        while len(_checked_specs) > CHECKED_MAX:
            _checked_specs.popitem(last=False)
