"""The Responses API's shapes without a cluster: input items as chat turns, a Responses body as the chat body it
means (and chat's errors renamed to the Responses fields), and one output builder for the stream and the whole
answer."""

from __future__ import annotations

import json
import re

import pytest

from services.gateway.edge.errors import InvalidRequest
from services.gateway.openai.structured_output import OutputPlan, plan_chat
from services.gateway.responses.chat_body import chat_request, renamed
from services.gateway.responses.items import chat_turns, input_items
from services.gateway.responses.output import OutputBuilder
from services.gateway.responses.schemas import ResponsesRequest

WEATHER = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_a_string_input_is_one_user_message_item():
    (item,) = input_items("hello")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]


def test_function_calls_join_the_assistant_turn_before_them_and_outputs_are_tool_turns():
    items = input_items(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ]
    )
    turns = chat_turns(items)
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[1]["content"] == "let me see" and [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"]
    assert turns[2] == {"role": "tool", "tool_call_id": "c1", "content": "1"}


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": "reasoning"}, "input[0].type"),
        ({"role": "tool", "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": "input_file"}]}, "input[0].content[0].type"),
        ({"role": "user", "content": "x", "extra": 1}, "input[0]"),
        ({"type": "function_call_output", "call_id": "c"}, "input[0].output"),
    ],
)
def test_a_bad_input_item_is_a_400_naming_its_path(item, param):
    with pytest.raises(InvalidRequest) as e:
        input_items([item])
    assert e.value.param == param


def test_instructions_come_first_and_flat_tools_become_chat_tools():
    chat = chat_request(
        _body(instructions="be brief", tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}),
        [{"role": "user", "content": "hi"}],
    )
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.tools == [{"type": "function", "function": {"name": "weather", "parameters": WEATHER["parameters"]}}]
    assert plan_chat(chat).tool_mode == "forced"


def test_a_json_schema_format_is_chat_s_response_format_and_its_errors_name_text_format():
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
    chat = chat_request(_body(text={"format": fmt}), [{"role": "user", "content": "hi"}])
    assert chat.response_format.model_extra == {"json_schema": {"name": "x", "schema": {"type": "object"}}}
    bad = chat_request(_body(text={"format": {**fmt, "name": ""}}), [{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequest) as e:
        plan_chat(bad)
    err = renamed(e.value)
    assert err.param == "text.format.name" and err.message.startswith("text.format.name:")


def test_streamed_pieces_and_the_whole_text_give_the_same_output():
    pieces = ["Hello", ", wor", "ld"]
    streamed = OutputBuilder(OutputPlan())
    events = [e for p in pieces for e in streamed.feed(p)]
    status, reason, closing = streamed.finish("length")
    whole = OutputBuilder(OutputPlan())
    whole.feed("".join(pieces))
    assert whole.finish("length")[:2] == (status, reason) == ("incomplete", "max_output_tokens")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello, world"
    strip = [{k: v for k, v in item.items() if k != "id"} for item in streamed.output]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole.output]
    assert [e["type"] for e in closing][-1] == "response.output_item.done"


def test_an_empty_answer_is_an_empty_message():
    out = OutputBuilder(OutputPlan())
    status, _reason, events = out.finish("stop")
    assert status == "completed" and out.output[0]["content"][0]["text"] == ""
    assert [e["type"] for e in events][:2] == ["response.output_item.added", "response.content_part.added"]


def _new_ids_named(events: list[dict], known: set[str]) -> str:
    """The events as JSON, each id not in known named by its order of appearance (new items' ids are random)."""
    text, seen = json.dumps(events), {}
    for found in re.findall(r'"((?:fc|call|msg)_[0-9a-f]+)"', text):
        if found not in known:
            seen.setdefault(found, f"new-{len(seen)}")
    for old, new in seen.items():
        text = text.replace(old, new)
    return text


def test_a_builder_fed_the_logged_text_at_once_continues_the_calls_another_builder_announced():
    calls = '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "weather", "arguments": {"city": "Rome"}}]'
    pieces = [calls[i : i + 5] for i in range(0, len(calls), 5)]
    first, second = OutputBuilder(OutputPlan(tool_mode="forced")), OutputBuilder(OutputPlan(tool_mode="forced"))
    logged = [e for p in pieces[:9] for e in first.feed(p)]  # the dead gateway's builder, up to its last log
    second.feed("".join(pieces[:9]))  # the takeover's: the same text in one piece, its events dropped
    announced = [(e["item"]["id"], e["item"]["call_id"]) for e in logged if "item" in e]
    second.adopt_ids(announced)
    known = {i for pair in announced for i in pair}
    rest = pieces[9:]
    went_on = [e for p in rest for e in second.feed(p)] + second.finish("stop")[2]
    would_have = [e for p in rest for e in first.feed(p)] + first.finish("stop")[2]
    assert known and _new_ids_named(went_on, known) == _new_ids_named(would_have, known)
