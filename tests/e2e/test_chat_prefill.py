"""vLLM's chat template fields and chat echo over HTTP against the session's simulated cluster: the prompt a chat
request is charged for is the one /tokenize renders with the same fields (continue_final_message: the last
assistant message continued, no new turn), echo starts the answer with that message, and every rule is a 400
naming its field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_fixtures import MODEL

PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "My favourite colour is"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def _post(cluster, path: str, **body) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json={"model": MODEL, **body}, timeout=60)


def _chat(cluster, **body) -> httpx.Response:
    return _post(cluster, "/v1/chat/completions", max_tokens=4, temperature=0, **body)


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "fields", [{}, {"add_generation_prompt": False}, CONTINUE], ids=["default", "no_generation_prompt", "continue"]
)
def test_a_chat_is_charged_the_prompt_tokenize_renders_with_the_same_fields(sim_cluster, fields):
    r = _chat(sim_cluster, messages=PREFILL, **fields)
    assert r.status_code == 200, r.text
    counted = _post(sim_cluster, "/tokenize", messages=PREFILL, **fields).json()
    assert r.json()["usage"]["prompt_tokens"] == counted["count"]


def test_continue_final_message_opens_no_new_turn(sim_cluster):
    ids = _post(sim_cluster, "/tokenize", messages=PREFILL, **CONTINUE).json()["tokens"]
    text = _post(sim_cluster, "/detokenize", tokens=ids).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_echo_starts_the_answer_with_the_last_assistant_message(sim_cluster, stream):
    body = dict(messages=PREFILL, echo=True, **CONTINUE)
    plain = _chat(sim_cluster, messages=PREFILL, **CONTINUE).json()["choices"][0]["message"]["content"]
    if not stream:
        content = _chat(sim_cluster, **body).json()["choices"][0]["message"]["content"]
    else:
        with httpx.stream(
            "POST",
            f"{sim_cluster.url}/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, **body},
        ) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
        content = "".join(json.loads(ln)["choices"][0]["delta"].get("content") or "" for ln in lines)
    assert content == PREFILL[-1]["content"] + plain


def test_echo_of_a_user_turn_adds_nothing(sim_cluster):
    plain = _chat(sim_cluster, messages=PREFILL[:1]).json()["choices"][0]["message"]["content"]
    assert _chat(sim_cluster, messages=PREFILL[:1], echo=True).json()["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_final_message_with_add_generation_prompt_is_a_400(sim_cluster, path):
    err = _error(_post(sim_cluster, path, messages=PREFILL, continue_final_message=True))
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"], err


@pytest.mark.parametrize(
    "kwargs, param",
    [({"tokenize": True}, "chat_template_kwargs.tokenize"), ({"big": "x" * 70_000}, "chat_template_kwargs")],
    ids=["reserved", "too_big"],
)
def test_unusable_chat_template_kwargs_are_a_400_naming_them(sim_cluster, kwargs, param):
    assert _error(_chat(sim_cluster, messages=PREFILL, chat_template_kwargs=kwargs))["param"] == param


def test_chat_template_kwargs_the_template_ignores_are_served(sim_cluster):
    r = _chat(sim_cluster, messages=PREFILL[:1], chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text


def test_echo_with_tools_is_a_400_naming_echo(sim_cluster):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _error(_chat(sim_cluster, messages=PREFILL, echo=True, tools=tools))["param"] == "echo"


def test_chat_fields_on_a_native_prompt_are_a_400_naming_them(sim_cluster):
    r = httpx.post(f"{sim_cluster.url}/generate", json={"prompt": "Hi", "continue_final_message": True}, timeout=60)
    assert _error(r)["param"] == "continue_final_message"
