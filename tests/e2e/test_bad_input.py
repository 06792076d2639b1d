"""Bad input: a 4xx with a JSON error naming the field and the limit; the next request is served."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}

CASES = [
    # (id, body, status, param, words the message must contain)
    ("missing_prompt", {"max_tokens": 5}, 400, "prompt", ["prompt", "messages"]),
    (
        "prompt_and_messages",
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        400,
        "prompt",
        ["exactly one"],
    ),
    ("empty_prompt", {"prompt": ""}, 400, "prompt", ["at least 1"]),
    ("max_tokens_zero", {**GOOD, "max_tokens": 0}, 400, "max_tokens", ["greater than or equal to 1"]),
    ("max_tokens_negative", {**GOOD, "max_tokens": -1}, 400, "max_tokens", ["greater than or equal to 1"]),
    ("max_tokens_huge", {**GOOD, "max_tokens": 10**6}, 400, "max_tokens", ["at most 4096"]),
    ("temperature_negative", {**GOOD, "temperature": -1}, 400, "temperature", ["greater than or equal to 0"]),
    ("top_p_zero", {**GOOD, "top_p": 0}, 400, "top_p", ["greater than 0"]),
    ("top_p_two", {**GOOD, "top_p": 2}, 400, "top_p", ["less than or equal to 1"]),
    ("max_tokens_string", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", ["integer"]),
    ("prompt_number", {"prompt": 5}, 400, "prompt", ["string"]),
    ("stream_string", {**GOOD, "stream": "yes"}, 400, "stream", ["boolean"]),
    ("messages_bad_role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ["user"]),
    ("unknown_field", {**GOOD, "max_tokenz": 3}, 400, "max_tokenz", ["not permitted"]),
]


def _assert_next_request_served(url: str) -> None:
    r = httpx.post(f"{url}/generate", json=GOOD, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_field_is_rejected_with_its_name_and_limit(cluster, case):
    _id, body, status, param, words = case
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], err
    _assert_next_request_served(cluster.url)


def test_prompt_longer_than_context_window_is_rejected(cluster):
    r = httpx.post(f"{cluster.url}/generate", json={"prompt": "hello " * 9000, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "too_long" and "8192" in err["message"]
    _assert_next_request_served(cluster.url)


def test_prompt_plus_max_tokens_over_context_window_is_rejected(cluster):
    r = httpx.post(f"{cluster.url}/generate", json={"prompt": "hello " * 6000, "max_tokens": 4000}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "at most" in err["message"]
    _assert_next_request_served(cluster.url)


def test_invalid_json_is_rejected(cluster):
    r = httpx.post(
        f"{cluster.url}/generate", content=b'{"prompt": "x",', timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    _assert_next_request_served(cluster.url)


def test_body_over_one_mebibyte_is_rejected(cluster):
    r = httpx.post(f"{cluster.url}/generate", json={"prompt": "x" * (1 << 20)}, timeout=30)
    assert r.status_code == 413, r.text
    assert "1048576" in r.json()["error"]["message"]
    _assert_next_request_served(cluster.url)


def test_chunked_body_over_limit_is_rejected(cluster):
    def body():
        for _ in range(20):
            yield b"x" * 65536

    r = httpx.post(f"{cluster.url}/generate", content=body(), timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 413
    _assert_next_request_served(cluster.url)


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


# Where a deep value is put (as JSON text: a value deeper than Python's own parser allows cannot be a dict here).
DEEP_FIELDS = {
    "tools": lambda v: (
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": '
        '{"type": "object", "default": %s}}}]' % v
    ),
    "tools.description": lambda v: '"tools": [{"type": "function", "function": {"name": "f", "description": %s}}]' % v,
    "response_format": lambda v: (
        '"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
        '"schema": {"type": "object", "default": %s}}}' % v
    ),
    "messages.1.tool_calls": lambda v: (
        '"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
        '"content": null, "tool_calls": [{"id": "c", "x": %s}]}]' % v
    ),
}
# Just over the limit, deep, and around where Python's parser gives up: there a value the parser managed broke
# json.dumps further down the stack (RecursionError, a 500); the spot moves with the stack's depth, so swept.
DEPTHS = [65, 300, *range(928, 976, 4), 5000]


@pytest.mark.parametrize("field", DEEP_FIELDS)
def test_a_deeply_nested_value_is_rejected_with_the_limit(cluster, field):
    model = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"][0]["id"]
    for depth in DEPTHS:
        part = DEEP_FIELDS[field](_nested(depth))
        messages = "" if field.startswith("messages") else '"messages": [{"role": "user", "content": "hi"}], '
        body = '{"model": "%s", "max_tokens": 2, %s%s}' % (model, messages, part)
        r = httpx.post(
            f"{cluster.url}/v1/chat/completions", content=body, timeout=30, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, (depth, r.text)
        err = r.json()["error"]
        assert err["code"] == "too_deep" and "64 levels" in err["message"], (depth, err)
        # Named when the body could be parsed; deeper than Python's parser goes, the body as a whole.
        assert err["param"] in (field.split(".description")[0], None), (depth, err)
    _assert_next_request_served(cluster.url)


def test_chunked_body_crossing_the_limit_is_not_run(cluster):
    """Its first mebibyte is a whole request (then padding): refused with 413 and never created, not run on a
    truncated body while the client is told 413."""
    marker = f"chunked-{uuid.uuid4().hex}"
    head = json.dumps({"prompt": marker, "max_tokens": 2}).encode()

    def body():
        yield head + b" " * (65536 - len(head))
        for _ in range(19):
            yield b" " * 65536

    r = httpx.post(f"{cluster.url}/generate", content=body(), timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1048576" in r.json()["error"]["message"], r.text
    client = cluster.client()
    created = [
        k
        for k in client.scan_iter(match=f"{cluster.ns}*:req:*:input", count=1000)
        if marker.encode() in (client.hget(k, "prompt") or b"")
    ]
    assert created == []
    _assert_next_request_served(cluster.url)
