"""The whole pipeline end to end: real Redis, four real service processes, the real model."""

from __future__ import annotations

import asyncio
import json

import httpx

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name three primary colors."},
        ]
    },
    {"prompt": "The quick brown fox"},
    {"prompt": "def fibonacci(n):"},
    {"prompt": "Once upon a time, in a land far away,"},
]
MAX_TOKENS = 24


def _expected(hf_reference, body: dict) -> list[int]:
    ids = hf_reference.prompt_ids(body.get("prompt"), body.get("messages"))
    return hf_reference(ids, MAX_TOKENS)


def _generate(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


async def _agenerate(client: httpx.AsyncClient, body: dict) -> dict:
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _astream(client: httpx.AsyncClient, body: dict) -> tuple[list[dict], dict]:
    events = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    return parsed[:-1], parsed[-1]


def test_greedy_output_equals_transformers_one_at_a_time(cluster, hf_reference):
    for body in PROMPTS:
        r = _generate(cluster.url, {**body, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["token_ids"] == _expected(hf_reference, body), body
        assert out["finish_reason"] in ("stop", "length")
        assert out["usage"]["completion_tokens"] == len(out["token_ids"])
        assert out["text"] == hf_reference.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_greedy_output_equals_transformers_all_at_once(cluster, hf_reference):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as client:
            return await asyncio.gather(
                *[_agenerate(client, {**b, "max_tokens": MAX_TOKENS, "temperature": 0}) for b in PROMPTS]
            )

    for body, out in zip(PROMPTS, asyncio.run(run())):
        assert out["token_ids"] == _expected(hf_reference, body), body


def test_sixteen_concurrent_streams_finish_and_match_non_stream_text(cluster):
    bodies = [
        {"prompt": f"Tell me a fact about the number {i}.", "max_tokens": 20, "temperature": 0} for i in range(16)
    ]

    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:
            streams = await asyncio.gather(*[_astream(client, b) for b in bodies])
            plain = await asyncio.gather(*[_agenerate(client, b) for b in bodies])
            return streams, plain

    streams, plain = asyncio.run(run())
    for (deltas, final), whole in zip(streams, plain):
        text = "".join(d["text"] for d in deltas) + final["text"]
        ids = [t for d in deltas for t in d["token_ids"]]
        assert final["finish_reason"] in ("stop", "length")
        assert text == whole["text"]
        assert ids == whole["token_ids"]
        assert final["usage"]["completion_tokens"] == len(ids)
        assert set(final["metrics"]) >= {"queue_wait", "ttft", "tpot", "e2e"}


def test_response_carries_usage_and_metrics(cluster):
    out = _generate(
        cluster.url, {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    ).json()
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5
    assert out["usage"]["prompt_tokens"] > 0 and out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 5
    m = out["metrics"]
    assert 0 <= m["queue_wait"] <= m["e2e"] and 0 < m["ttft"] <= m["e2e"] and m["tpot"] >= 0


def test_request_status_shows_state_history_and_all_layers(cluster):
    out = _generate(cluster.url, {"prompt": "Hi", "max_tokens": 3, "temperature": 0}).json()
    r = httpx.get(f"{cluster.url}/v1/requests/{out['request_id']}", timeout=10)
    assert r.status_code == 200
    snap = r.json()
    assert snap["state"] == "FINISHED"
    states = [h["state"] for h in snap["history"]]
    assert states == ["RECEIVED", "PREPROCESSED", "QUEUED", "SCHEDULED", "PREFILLING", "DECODING", "FINISHED"]
    assert [h["service"] for h in snap["history"]] == [
        "gateway",
        "tokenizer",
        "scheduler",
        "scheduler",
        "worker",
        "worker",
        "worker",
    ]
    times = [h["t"] for h in snap["history"]]
    assert times == sorted(times)
    for layer in ("meta", "input", "exec", "kv", "output"):
        assert snap[layer], layer
    assert snap["input"]["prompt"] == "Hi" and snap["output"]["token_ids"] == out["token_ids"]
    assert snap["kv"]["blocks"] >= 1 and snap["exec"]["worker_id"]


def test_unknown_request_is_404(cluster):
    r = httpx.get(f"{cluster.url}/v1/requests/{'0' * 32}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"


def test_health_and_ready(cluster):
    assert httpx.get(f"{cluster.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{cluster.url}/ready").json()
    assert ready["status"] == "ready" and ready["live"]["worker"] == 1 and ready["live"]["tokenizer"] == 1
