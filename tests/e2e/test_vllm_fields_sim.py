"""vLLM's smaller fields over HTTP against the session's simulated cluster: the queue wait (x-queue-time header; a
stream's first line, an SSE comment), truncate_prompt_tokens, and usage's cached_tokens always present."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.support.openai_fixtures import MODEL

PATHS = ["/v1/completions", "/v1/chat/completions", "/generate"]


def _body(path: str, prompt: str = "Once upon a time", **kw) -> dict:
    if path == "/generate":
        return {"prompt": prompt, **kw}
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": prompt, **kw}
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **kw}


@pytest.mark.parametrize("path", PATHS)
def test_an_answer_carries_its_queue_wait_in_x_queue_time(sim_cluster, path):
    r = httpx.post(f"{sim_cluster.url}{path}", json=_body(path, max_tokens=2), timeout=60)
    assert r.status_code == 200, r.text
    assert float(r.headers["x-queue-time"]) >= 0.0


@pytest.mark.parametrize("path", PATHS)
def test_a_stream_opens_with_its_queue_wait_as_an_sse_comment(sim_cluster, path):
    body = _body(path, max_tokens=2, stream=True)
    with httpx.stream("POST", f"{sim_cluster.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[0].startswith(": queue_time="), lines[:2]
    assert float(lines[0].removeprefix(": queue_time=")) >= 0.0
    if path != "/generate":  # an OpenAI stream answers once the first output came: the wait is known by then
        assert r.headers["x-queue-time"] == lines[0].removeprefix(": queue_time=")
    assert all(ln.startswith("data: ") for ln in lines[1:])


@pytest.mark.parametrize("path", PATHS)
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(sim_cluster, path):
    body = _body(path, prompt="one two three " * 40, max_tokens=2, truncate_prompt_tokens=7)
    r = httpx.post(f"{sim_cluster.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 7


def test_truncate_minus_one_leaves_a_prompt_that_fits_whole(sim_cluster):
    whole = httpx.post(f"{sim_cluster.url}/v1/completions", json=_body("/v1/completions", max_tokens=2), timeout=60)
    body = _body("/v1/completions", max_tokens=2, truncate_prompt_tokens=-1)
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]


def test_truncating_a_token_id_prompt_beyond_the_window_serves_it(sim_cluster):
    window = httpx.get(f"{sim_cluster.url}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": [42] * (window + 10), "max_tokens": 2, "truncate_prompt_tokens": 16}
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 16


@pytest.mark.parametrize("value", [0, -2])
def test_a_truncate_prompt_tokens_below_its_range_is_a_400_naming_it(sim_cluster, value):
    body = _body("/v1/completions", max_tokens=2, truncate_prompt_tokens=value)
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_usage_has_cached_tokens_zero_included(sim_cluster):
    body = _body("/v1/completions", prompt=f"{uuid.uuid4().hex} is a fresh prompt", max_tokens=2)
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_usage_has_cached_tokens_too(sim_cluster):
    r = httpx.post(f"{sim_cluster.url}/v1/chat/completions", json=_body("chat", max_tokens=2), timeout=60)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and 0 <= cached <= r.json()["usage"]["prompt_tokens"]


def _chunks(cluster, path: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{cluster.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


@pytest.mark.parametrize("path", PATHS[:2])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(sim_cluster, path):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(sim_cluster, path, **_body(path, max_tokens=6, n=2, stream=True, stream_options=options))
    final = chunks[-1]["usage"]
    assert not chunks[-1]["choices"] and final["completion_tokens"] > 0
    seen: dict[int, int] = {}
    for c in chunks[:-1]:
        u, index = c["usage"], c["choices"][0]["index"]
        assert (
            u["prompt_tokens"] == final["prompt_tokens"]
            and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        )
        assert u["completion_tokens"] >= seen.get(index, 0)  # never backwards within a choice
        seen[index] = u["completion_tokens"]
    assert sum(seen.values()) == final["completion_tokens"]


def test_continuous_usage_stats_without_include_usage_is_a_400_naming_it(sim_cluster):
    body = _body("/v1/completions", max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True})
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


@pytest.mark.parametrize("path", PATHS[:2])
def test_return_token_ids_gives_the_output_and_prompt_ids(sim_cluster, path):
    body = _body(path, max_tokens=5, return_token_ids=True, temperature=0)
    out = httpx.post(f"{sim_cluster.url}{path}", json=body, timeout=60).json()
    native = httpx.post(f"{sim_cluster.url}/generate", json={**_native(path), "max_tokens": 5, "temperature": 0})
    choice = out["choices"][0]
    assert choice["token_ids"] == native.json()["token_ids"]
    prompt = choice["prompt_token_ids"] if path == "/v1/completions" else out["prompt_token_ids"]
    assert len(prompt) == out["usage"]["prompt_tokens"]
    assert prompt == httpx.post(f"{sim_cluster.url}/tokenize", json=_native(path), timeout=30).json()["tokens"]


@pytest.mark.parametrize("path", PATHS[:2])
def test_a_streams_token_ids_add_up_to_the_whole_answers(sim_cluster, path):
    body = _body(path, max_tokens=5, return_token_ids=True, temperature=0)
    whole = httpx.post(f"{sim_cluster.url}{path}", json=body, timeout=60).json()
    chunks = _chunks(sim_cluster, path, **body, stream=True)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert ids == whole["choices"][0]["token_ids"]
    prompts = [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] + [
        c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]
    ]
    assert prompts == [whole["choices"][0].get("prompt_token_ids") or whole["prompt_token_ids"]]


def _native(path: str) -> dict:
    """The native body of _body(path)'s prompt (what /generate and /tokenize take)."""
    if path == "/v1/completions":
        return {"prompt": "Once upon a time"}
    return {"messages": [{"role": "user", "content": "Once upon a time"}]}


# vLLM's documented request fields Conveyor does not honour: each is refused by name, never silently ignored
UNSUPPORTED_BOTH = [
    "use_beam_search",
    "length_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "add_special_tokens",
    "logits_processors",
    "return_tokens_as_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "truncation_side",
]
UNSUPPORTED_CHAT = ["documents", "chat_template", "mm_processor_kwargs", "include_reasoning"]


@pytest.mark.parametrize(
    "path, field",
    [(p, f) for p in PATHS[:2] for f in UNSUPPORTED_BOTH] + [("/v1/chat/completions", f) for f in UNSUPPORTED_CHAT],
)
def test_a_vllm_field_conveyor_does_not_honour_is_a_400_naming_it(sim_cluster, path, field):
    r = httpx.post(f"{sim_cluster.url}{path}", json=_body(path, max_tokens=2, **{field: True}), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_completion_takes_response_format_as_vllm(sim_cluster):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = _body("/v1/completions", max_tokens=60, temperature=0, response_format=fmt)
    choice = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"])["a"], int), choice
