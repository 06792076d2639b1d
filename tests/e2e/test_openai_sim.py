"""The OpenAI API's request and answer rules where the model's numbers do not matter, over HTTP against the session's
simulated cluster: a tool-calling conversation's second step, a forced tool call cut by max_tokens (streamed and
whole alike), the seed's int64 range, and logit_bias's rules."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_fixtures import MODEL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALLED = {
    "role": "assistant",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_current_weather", "arguments": '{"city": "P"}'}}
    ],
}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}
FORCED = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_current_weather"}},
}


def _chat(cluster, **body) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def _streamed(cluster, **body) -> dict:
    """A streamed chat answer put together as the non-stream message: content, calls (name, arguments), finish."""
    content, calls, finish = "", {}, None
    with httpx.stream(
        "POST", f"{cluster.url}/v1/chat/completions", json={"model": MODEL, "stream": True, **body}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                call["arguments"] += d["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def _whole(cluster, **body) -> dict:
    r = _chat(cluster, **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in choice["message"].get("tool_calls") or []
    ]
    return {"content": choice["message"]["content"], "calls": calls, "finish_reason": choice["finish_reason"]}


@pytest.mark.parametrize("follow", [[], [ANSWERED]], ids=["calls_last", "tool_result_after"])
def test_an_assistant_turn_of_tool_calls_may_leave_content_out(sim_cluster, follow):
    r = _chat(sim_cluster, messages=[*ASK, CALLED, *follow], tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "system"},
        {"role": "developer"},
        {"role": "tool", "tool_call_id": "call_1"},
        {"role": "assistant"},
        {"role": "assistant", "tool_calls": []},
    ],
    ids=["user", "system", "developer", "tool", "assistant_without_calls", "assistant_no_calls_given"],
)
def test_content_is_still_required_where_openai_requires_it(sim_cluster, message):
    r = _chat(sim_cluster, messages=[*ASK, message], max_tokens=4)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.content" and "Field required" in err["message"], err


@pytest.mark.parametrize("choice", FORCED, ids=list(FORCED))
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 14, 20])
def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_or_whole(sim_cluster, choice, max_tokens):
    body = dict(messages=ASK, tools=[WEATHER], tool_choice=FORCED[choice], max_tokens=max_tokens, temperature=0)
    whole, streamed = _whole(sim_cluster, **body), _streamed(sim_cluster, **body)
    assert whole == streamed
    # the call array is the answer: none of its raw text is content, whatever is cut
    assert whole["finish_reason"] == "length" and whole["content"] is None
    assert all(c["name"] == "get_current_weather" for c in whole["calls"])


@pytest.mark.parametrize("seed", [-1, -(2**63), -123456789])
def test_a_negative_seed_is_served_and_gives_the_same_tokens_again(sim_cluster, seed):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": seed}
    outs = [httpx.post(f"{sim_cluster.url}/v1/completions", json={"model": MODEL, **body}, timeout=60) for _ in "ab"]
    assert [r.status_code for r in outs] == [200, 200], outs[0].text
    assert outs[0].json()["choices"][0]["text"] == outs[1].json()["choices"][0]["text"]
    native = [httpx.post(f"{sim_cluster.url}/generate", json=body, timeout=60) for _ in "ab"]
    assert [r.status_code for r in native] == [200, 200], native[0].text
    assert native[0].json()["token_ids"] == native[1].json()["token_ids"]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_seed_outside_int64_is_a_400_naming_seed_and_the_limit(sim_cluster, seed, path):
    body = {"prompt": "Hello", "max_tokens": 2, "seed": seed} | ({"model": MODEL} if path.startswith("/v1") else {})
    r = httpx.post(f"{sim_cluster.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "seed" and str(2**63 - 1 if seed > 0 else -(2**63)) in err["message"], err


@pytest.mark.parametrize(
    "bias, why",
    [({"10": 101}, "above 100"), ({"10": -100.5}, "below -100"), ({"ten": 5}, "not an id"), ({"99999999": 1}, "vocab")],
)
def test_a_logit_bias_outside_its_rules_is_a_400_naming_it(sim_cluster, bias, why):
    r = _chat(sim_cluster, messages=ASK, max_tokens=2, logit_bias=bias)
    assert r.status_code == 400, (why, r.text)
    assert r.json()["error"]["param"].startswith("logit_bias"), why


def test_a_logit_bias_within_its_rules_is_served(sim_cluster):
    r = _chat(sim_cluster, messages=ASK, max_tokens=2, logit_bias={"10": 100, "11": -100})
    assert r.status_code == 200, r.text
