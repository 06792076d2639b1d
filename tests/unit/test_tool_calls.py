"""Tool calls at the gateway, without a cluster: the call schema, the streaming parser, auto-mode parsing and the
checks of tools and response_format (services/gateway/openai/tool_calls.py, structured_output.py, openai_tools.py)."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.gateway.edge.errors import InvalidRequest
from services.gateway.openai.schemas import ChatCompletionRequest
from services.gateway.openai.tools import ToolShaper, message
from services.gateway.openai.structured_output import plan_chat
from services.gateway.openai.tool_calls import CallParser, Tool, call_schema
from shared.text.grammar import grammar_for

CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Par}is\\\\", "q": "a\\"b", "n": [1, {"a": 2}]}}, '
    '{"name": "search", "arguments": {}}]'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)


def _param(**body) -> str:
    with pytest.raises(InvalidRequest) as e:
        plan_chat(_chat(**body))
    return e.value.param


def test_streamed_argument_fragments_concatenate_to_the_whole_arguments_at_any_split():
    whole = CallParser()
    whole.feed(CALLS)
    assert whole.complete and [c.name for c in whole.calls] == ["get_weather", "search"]
    assert json.loads(whole.calls[0].arguments) == {"city": "Par}is\\", "q": 'a"b', "n": [1, {"a": 2}]}
    for size in (1, 2, 3, 7):
        parser, fragments = CallParser(), {0: "", 1: ""}
        for i in range(0, len(CALLS), size):
            for d in parser.feed(CALLS[i : i + size]):
                fragments[d["index"]] += d["function"]["arguments"]
        assert parser.complete and fragments == {i: c.arguments for i, c in enumerate(whole.calls)}


def test_each_call_starts_with_its_id_type_and_name_before_any_argument():
    deltas = CallParser().feed(CALLS)
    first = deltas[0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}


def test_call_schema_moves_each_functions_defs_to_the_root_so_refs_resolve(model_dir):
    params = {
        "type": "object",
        "$defs": {"unit": {"enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/unit"}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tools = [Tool("a", params, {}), Tool("b", params, {})]
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2])
    m = llguidance.LLMatcher(tok, grammar_for("json_schema", call_schema(tools, parallel=True)), log_level=0)
    good, bad = m.deep_copy(), m.deep_copy()
    assert good.consume_tokens(tok.tokenize_str('[{"name": "b", "arguments": {"unit": "f"}}]')) and not good.is_error()
    assert not bad.consume_tokens(tok.tokenize_str('[{"name": "b", "arguments": {"unit": "k"}}]'))


def test_auto_grammar_takes_text_or_valid_calls_and_nothing_else(model_dir):
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2])
    plan = plan_chat(_chat(tools=[WEATHER]))
    grammar = grammar_for(plan.constraint.kind, plan.constraint.spec)

    def takes(text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()

    assert takes("The weather is nice.") and takes('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert not takes('[{"name": "other", "arguments": {}}]') and not takes('[{"name": "get_weather", "arguments": {}}]')


def test_auto_answer_is_calls_when_it_starts_with_a_bracket_and_content_otherwise():
    plan = plan_chat(_chat(tools=[WEATHER]))
    text = ToolShaper(plan)
    assert text.feed("The") == [{"content": "The"}] and text.feed(" sky") == [{"content": " sky"}]
    assert text.finish_reason("stop") == "stop"
    calls = ToolShaper(plan)
    head = calls.feed('[{"name": "get_weather", ')  # the name is out as soon as it is complete
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls.feed('"arguments": {"city": "Oslo"}}]') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}
    ]
    assert calls.calls[0].arguments == '{"city": "Oslo"}' and calls.finish_reason("stop") == "tool_calls"


def test_a_cut_forced_call_keeps_finish_reason_length():
    plan = plan_chat(_chat(tools=[WEATHER], tool_choice="required"))
    msg, finish = message(plan, '[{"name": "get_weather", "arguments": {"ci', "length")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"ci'


def _streamed_message(plan, text: str) -> dict:
    """The message a client puts together from the stream's deltas of text, fed a character at a time."""
    shaper, content, calls = ToolShaper(plan), "", {}
    for ch in text:
        for delta in shaper.feed(ch):
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                call["arguments"] += d["function"]["arguments"]
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("tool_choice", [None, "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_cut_anywhere_gives_the_stream_and_the_whole_answer_the_same_message(tool_choice):
    plan = plan_chat(_chat(tools=[WEATHER], tool_choice=tool_choice))
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    for cut in range(1, len(text)):
        msg, finish = message(plan, text[:cut], "length")
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls") or []
        ]
        assert {"content": msg["content"], "calls": calls} == _streamed_message(plan, text[:cut]), text[:cut]
        assert finish == "length" and msg["content"] is None  # the call array's raw text is never content


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"tools": [WEATHER], "min_tokens": 3}, "min_tokens"),
    ],
)
def test_bad_structured_output_field_is_refused_naming_it(body, param):
    assert _param(**body) == param
