"""The Responses API (/v1/responses) through the official client against simulated workers behind API keys: the
answer is chat completions' for the same conversation in the Responses shape (text, function calls, json_schema),
fields it cannot honour are a 400 naming them, stored responses are retrieved, listed, continued and deleted by
their own key only, and a stream's events add up to the stored response."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.cluster import KEY_A, KEY_B, auth
from tests.support.openai_fixtures import MODEL, openai_client, snapshot
from tests.support.waiting import wait_for

WEATHER = {
    "type": "function",
    "name": "get_current_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(keyed_cluster):
    return openai_client(keyed_cluster.url, api_key=KEY_A)


@pytest.fixture(scope="module")
def other(keyed_cluster):
    return openai_client(keyed_cluster.url, api_key=KEY_B)


def _chat(cluster, **body) -> dict:
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": MODEL, **body}, headers=auth(KEY_A), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _post(cluster, **body) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/responses", json={"model": MODEL, **body}, headers=auth(KEY_A), timeout=60)


def test_a_string_input_is_answered_with_a_message_and_the_usage(client):
    resp = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=8, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status in ("completed", "incomplete")
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"
    assert resp.output_text == resp.output[0].content[0].text
    u = resp.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 1 <= u.output_tokens <= 8
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0


def test_greedy_text_and_prompt_equal_chat_completions_for_the_same_conversation(client, keyed_cluster):
    turns = [
        {"role": "user", "content": "Name a river"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "The Loire."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And a sea?"}]},
    ]
    resp = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input=turns, max_output_tokens=10, temperature=0
    )
    messages = [{"role": "system", "content": "Answer briefly."}, *turns[:1]]
    messages += [{"role": "assistant", "content": "The Loire."}, {"role": "user", "content": "And a sea?"}]
    chat = _chat(keyed_cluster, messages=messages, max_tokens=10, temperature=0)
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_an_output_cut_by_max_output_tokens_is_incomplete_with_the_reason(client):
    resp = client.responses.create(model=MODEL, input="Count to fifty", max_output_tokens=1, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 1


def test_a_required_tool_is_answered_with_a_function_call_item(client):
    resp = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    assert resp.status == "completed", resp
    call = resp.output[0]
    assert call.type == "function_call" and call.name == "get_current_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}


def test_function_call_items_and_their_outputs_are_the_chat_turns_of_tool_calls(client, keyed_cluster):
    items = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_current_weather", "arguments": '{"city": "P"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'},
    ]
    resp = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=6, temperature=0)
    called = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_current_weather", "arguments": '{"city": "P"}'},
    }
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [called]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    chat = _chat(keyed_cluster, messages=messages, tools=[CHAT_WEATHER], max_tokens=6, temperature=0)
    assert resp.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_json_schema_format_gives_json_of_that_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["Ada", "Alan"]}},
        "required": ["name"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL,
        input="Give me a name as JSON",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert resp.status == "completed"
    assert set(json.loads(resp.output_text)) == {"name"}


@pytest.mark.parametrize(
    "field, param",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True, "store": False}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_field_conveyor_cannot_honour_is_a_400_naming_it(keyed_cluster, field, param):
    r = _post(keyed_cluster, **{"input": "hi", **field})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_stored_response_is_retrieved_listed_and_deleted(client):
    resp = client.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=4, temperature=0, metadata={"k": "v"}
    )
    got = client.responses.retrieve(resp.id)
    assert got.output_text == resp.output_text and got.metadata == {"k": "v"} and got.status == resp.status
    items = client.responses.input_items.list(resp.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_a_response_not_stored_cannot_be_retrieved(client):
    resp = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_previous_response_id_puts_its_input_and_output_before_the_new_input(client):
    first = client.responses.create(model=MODEL, input="Name a river", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="And a sea?", max_output_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    same = [
        {"role": "user", "content": "Name a river"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a sea?"},
    ]
    whole = client.responses.create(model=MODEL, input=same, max_output_tokens=6, temperature=0)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text


def test_another_key_cannot_see_delete_or_continue_a_response(client, other):
    resp = client.responses.create(model=MODEL, input="Mine", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model=MODEL, input="Yours?", previous_response_id=resp.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(resp.id).id == resp.id


def _events(client, **body) -> list:
    with client.responses.stream(model=MODEL, **body) as stream:
        return list(stream)


def test_a_stream_s_events_come_in_order_and_add_up_to_the_stored_response(client):
    events = _events(client, input="Tell me a story", max_output_tokens=12, temperature=0)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.content_part.added"
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{events[-1].response.status}",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and text == final.output_text == client.responses.retrieve(final.id).output_text
    whole = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0)
    assert whole.output_text == text


def test_a_streamed_function_call_s_argument_deltas_add_up_to_its_arguments(client):
    events = _events(
        client,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and len(done) == 1
    assert args == done[0].arguments == final.output[0].arguments
    assert client.responses.retrieve(final.id).output[0].call_id == final.output[0].call_id


def _ended(client, response_id: str):
    got = client.responses.retrieve(response_id)
    return got if got.status not in ("queued", "in_progress") else None


def test_a_background_response_is_queued_at_once_and_polling_sees_its_answer(client):
    resp = client.responses.create(
        model=MODEL, input="Tell me a tale", background=True, max_output_tokens=8, temperature=0
    )
    assert resp.status == "queued" and resp.background is True and resp.output == []
    done = wait_for(lambda: _ended(client, resp.id), 60, what="the background response's end")
    whole = client.responses.create(model=MODEL, input="Tell me a tale", max_output_tokens=8, temperature=0)
    assert done.status == whole.status and done.output_text == whole.output_text and done.background is True
    assert done.usage.output_tokens == whole.usage.output_tokens


def test_a_cancelled_background_response_stays_cancelled_and_its_work_stops(client, keyed_cluster):
    resp = client.responses.create(model=MODEL, input="Count to a thousand", background=True, max_output_tokens=400)
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    rid = resp.id.removeprefix("resp_")
    headers = auth(KEY_A)
    wait_for(lambda: snapshot(keyed_cluster.url, rid, headers)["state"] == "CANCELLED", 30, what="the work stopped")
    assert client.responses.retrieve(resp.id).status == "cancelled"


def test_only_a_background_response_can_be_cancelled(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(resp.id)
    assert e.value.body["param"] == "response_id"


def test_a_response_id_names_its_request_in_the_requests_api(client, keyed_cluster):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert snapshot(keyed_cluster.url, resp.id, auth(KEY_A))["state"] == "FINISHED"


def test_a_continuation_of_a_session_s_response_is_the_session_s_next_turn_and_reuses_its_kv(client, keyed_cluster):
    first = client.responses.create(
        model=MODEL, input="Tell me about the sea " * 8, max_output_tokens=4, extra_headers={"X-Session-ID": "resp-1"}
    )
    second = client.responses.create(
        model=MODEL, input="And rivers?", previous_response_id=first.id, max_output_tokens=4
    )
    s = httpx.get(f"{keyed_cluster.url}/v1/sessions/resp-1", headers=auth(KEY_A), timeout=10).json()
    assert s["turns"] == 2 and s["state"] == "PAUSED"
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16


def test_a_prompt_beyond_the_context_names_input_and_max_output_tokens_beyond_it_names_that(keyed_cluster):
    too_long = _post(keyed_cluster, input="hello " * 9000, max_output_tokens=4)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input", too_long.text
    crowded = _post(keyed_cluster, input="hello " * 5000, max_output_tokens=4000)
    assert crowded.status_code == 400 and crowded.json()["error"]["param"] == "max_output_tokens", crowded.text
    assert "max_output_tokens" in crowded.json()["error"]["message"]


def test_a_function_call_answered_by_its_output_continues_the_stored_conversation(client, keyed_cluster):
    tools = dict(tools=[WEATHER], parallel_tool_calls=False, temperature=0)
    called = client.responses.create(model=MODEL, input=ASK, tool_choice="required", max_output_tokens=60, **tools)
    call = called.output[0]
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    final = client.responses.create(
        model=MODEL, previous_response_id=called.id, input=answer, max_output_tokens=6, **tools
    )
    assert final.status in ("completed", "incomplete")
    same = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *answer,
    ]
    whole = client.responses.create(model=MODEL, input=same, max_output_tokens=6, **tools)
    assert whole.usage.input_tokens == final.usage.input_tokens and whole.output_text == final.output_text


def test_a_background_stream_gives_the_stored_response_s_events_and_resumes_after_a_sequence_number(client):
    body = dict(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(background=True, stream=True, **body))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[-1].type == f"response.{events[-1].response.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    stored = client.responses.retrieve(events[0].response.id)
    assert text == stored.output_text == client.responses.create(**body).output_text
    k = len(events) // 2
    again = list(client.responses.retrieve(stored.id, stream=True, starting_after=k))
    assert [e.sequence_number for e in again] == list(range(k + 1, len(events)))
    assert [e.type for e in again] == [e.type for e in events[k + 1 :]]


def test_only_a_background_response_created_streaming_can_be_streamed_again(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True)
    with pytest.raises(openai.BadRequestError) as e:
        list(client.responses.retrieve(resp.id, stream=True))
    assert e.value.body["param"] == "stream"


def test_a_cancelled_background_stream_ends_with_its_failure(client):
    stream = client.responses.create(
        model=MODEL, input="Count to a thousand", background=True, stream=True, max_output_tokens=400
    )
    first = next(iter(stream))
    client.responses.cancel(first.response.id)
    rest = list(stream)
    assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"


def test_a_background_prompt_beyond_the_context_fails_naming_input(client):
    resp = client.responses.create(model=MODEL, input="hello " * 9000, background=True, max_output_tokens=4)
    failed = wait_for(lambda: _ended(client, resp.id), 30, what="the refused prompt's end")
    assert failed.status == "failed" and failed.error.message.startswith("input")


def test_a_running_background_response_cannot_be_continued_yet(client):
    resp = client.responses.create(model=MODEL, input="Count to a thousand", background=True, max_output_tokens=400)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="and?", previous_response_id=resp.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.cancel(resp.id)
