"""response_format (json_object, json_schema) and forced tool calls through the official `openai` client against a
real cluster and model: every output parses and validates, tool calls come in OpenAI's shape, bad schemas are 400s
naming the field, and a max_tokens cut is finish_reason "length"."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.openai_fixtures import MODEL, request_id, snapshot, worker_idle
from tests.support.waiting import wait_for

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Give me a person as JSON."}]
ASK_CAPITAL = [
    {"role": "user", "content": 'Reply with a JSON object with the key "capital" for the capital of France.'}
]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLINGS = {"greedy": {"temperature": 0}, "sampled": {"temperature": 1.0, "seed": 1234}}


def _answer(client, stream: bool, **kw) -> tuple[str, str]:
    """(content, finish_reason), from a stream's deltas or the whole answer."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, **kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kw) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def _calls(client, stream: bool, **kw) -> tuple[list[dict], str]:
    """([{id, name, arguments}], finish_reason): a stream's tool-call deltas put together by index."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, **kw)
        assert out.choices[0].message.content is None
        calls = out.choices[0].message.tool_calls or []
        return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls], out.choices[
            0
        ].finish_reason
    calls: dict[int, dict] = {}
    chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kw) if c.choices]
    for chunk in chunks:
        assert not chunk.choices[0].delta.content
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta names it; argument fragments follow
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=list(SAMPLINGS))
def test_json_schema_output_parses_and_validates(client, stream, sampling):
    text, finish = _answer(
        client, stream, messages=ASK_PERSON, max_tokens=60, response_format=PERSON_FORMAT, **SAMPLINGS[sampling]
    )
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=list(SAMPLINGS))
def test_json_object_output_is_one_json_object(client, stream, sampling):
    text, finish = _answer(
        client,
        stream,
        messages=ASK_CAPITAL,
        max_tokens=80,
        response_format={"type": "json_object"},
        **SAMPLINGS[sampling],
    )
    assert finish == "stop" and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_choice_required_gives_valid_calls_of_the_given_tools(client, stream):
    calls, finish = _calls(
        client, stream, messages=ASK_WEATHER, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required"
    )
    assert finish == "tool_calls" and calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_named_tool_choice_calls_that_function_once(client, stream):
    calls, finish = _calls(
        client,
        stream,
        messages=ASK_WEATHER,
        max_tokens=80,
        temperature=1.0,
        seed=7,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[1]["function"]["parameters"])


def test_streamed_call_arguments_equal_the_non_stream_ones(client):
    kw = dict(messages=ASK_WEATHER, max_tokens=80, temperature=0, tools=TOOLS, tool_choice="required")
    whole, _ = _calls(client, False, **kw)
    streamed, _ = _calls(client, True, **kw)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in whole]


def test_tool_results_in_the_conversation_are_accepted(client):
    turns = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=turns, max_tokens=8, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "fmt, param",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, response_format=fmt)
    assert e.value.status_code == 400 and e.value.param == param


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_max_tokens_cut_of_a_json_output_is_finish_reason_length(client, stream):
    text, finish = _answer(
        client, stream, messages=ASK_PERSON, max_tokens=4, temperature=0, response_format=PERSON_FORMAT
    )
    assert finish == "length" and text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_round_trip(cluster, method):
    chat_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed").ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    llm = chat_openai(
        model=MODEL, base_url=f"{cluster.url}/v1", api_key="unused", temperature=0, max_tokens=60, max_retries=0
    )
    person = llm.with_structured_output(Person, method=method).invoke("Give me a person as JSON.")
    assert isinstance(person, Person) and person.name


def test_a_constrained_stream_closed_by_its_client_is_cancelled_and_frees_the_worker(client, cluster):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        max_tokens=400,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    first = next(iter(stream))
    stream.close()
    rid = request_id(first.id)
    wait_for(lambda: snapshot(cluster.url, rid)["state"] == "CANCELLED", 30, what="request cancelled")
    wait_for(lambda: worker_idle(cluster), 30, what="worker released every block")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_auto_answer_is_text_or_valid_calls(client, stream):
    kw = dict(messages=ASK_WEATHER, max_tokens=24, temperature=1.0, seed=3, tools=TOOLS)
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
        text, finish = choice.message.content, choice.finish_reason
    else:
        chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls, finish = [], chunks[-1].choices[0].finish_reason
        if any(c.choices[0].delta.tool_calls for c in chunks):
            calls, finish = _calls(client, True, **kw)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if calls:  # the model chose to call: every call is of a given tool, with valid arguments
        assert finish == "tool_calls" and not text
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])
    else:
        assert text and not text.startswith("[") and finish in ("stop", "length")


def test_each_of_n_choices_is_a_valid_named_call_streamed_as_whole(client):
    kw = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        max_tokens=80,
        temperature=1.0,
        seed=3,
        n=2,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    whole = client.chat.completions.create(**kw)
    args: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                args[c.index] = args.get(c.index, "") + (call.function.arguments or "")
    assert [c.index for c in whole.choices] == [0, 1]
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_time"]
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])
        assert args[c.index] == c.message.tool_calls[0].function.arguments
