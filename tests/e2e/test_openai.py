"""The OpenAI-compatible API through the official `openai` client: shapes, streams, stop, seed, usage, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.openai_fixtures import MODEL, request_id, snapshot

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _native(cluster, **body) -> dict:
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_list_names_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_with_max_tokens_ends_with_length_and_counts_tokens(client, tokenizer):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_completion_stream_text_equals_non_stream_text(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_stream_equals_non_stream_and_usage_equals_token_counts(client, cluster):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage  # the second run may hit the prefix cache: cached_tokens can differ
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )
    native = _native(cluster, messages=CHAT, max_tokens=12, temperature=0)
    assert native["text"] == text
    assert whole.usage.completion_tokens == len(native["token_ids"])
    assert whole.usage.prompt_tokens == native["usage"]["prompt_tokens"]


def test_same_seed_gives_same_text(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=1234)
    first, second = (client.chat.completions.create(**kw) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content


def test_stop_string_ends_output_before_it(client, cluster):
    reference = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == reference[: reference.index(stop)]
    snap = snapshot(cluster.url, request_id(out.id))
    assert snap["state"] == "FINISHED" and snap["history"][-1]["reason"] == "stop_string"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_unsupported_or_invalid_parameter_raises_bad_request_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"


def test_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and MODEL in e.value.message


def test_stream_of_too_long_prompt_is_a_400_not_a_broken_stream(client):
    with pytest.raises(openai.BadRequestError) as e:
        list(client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4, stream=True))
    assert e.value.code == "too_long"


def test_body_over_limit_is_413_in_openai_error_shape(cluster):
    r = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 20)}]},
    )
    assert r.status_code == 413
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_native_generate_honours_stop_too(cluster):
    reference = _native(cluster, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)["text"]
    stop = reference[3:6]
    out = _native(cluster, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
    assert out["finish_reason"] == "stop" and out["text"] == reference[: reference.index(stop)]
    assert out["usage"]["completion_tokens"] == len(out["token_ids"])


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"prompt": "bad \ud800 text"}, "prompt", "string_unicode"),  # a lone surrogate: it cannot be encoded
        ({"stop_token_ids": [10**6]}, "stop_token_ids", "token_id_out_of_range"),
    ],
)
def test_input_the_pipeline_cannot_carry_is_a_400_not_a_500(cluster, extra, param, code):
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra})  # ASCII: "\\ud800" escaped
    r = httpx.post(
        f"{cluster.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
