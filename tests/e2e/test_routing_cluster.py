"""KV-cache-aware routing end to end: real gateway, tokenizer, scheduler and Redis, two simulated workers
(CONVEYOR_ENGINE=sim: the real engine scheduler, block manager and prefix cache, modelled step times)."""

from __future__ import annotations

import httpx

from tests.support.cluster import Cluster, cluster_fixture
from tests.support.openai_fixtures import MODEL

CONTEXT = (
    "Background for this conversation: the river {i} runs from the northern hills through three old "
    "mill towns, past a cathedral, a market square and a long stone bridge, to the sea. "
) * 6


cluster = cluster_fixture(
    "routing", workers=2, env={"CONVEYOR_ENGINE": "sim", "CONVEYOR_SIM_SPEEDUP": "10", "CONVEYOR_ROUTING": "kv"}
)


def status(c: Cluster, request_id: str) -> dict:
    r = httpx.get(f"{c.url}/v1/requests/{request_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def completion(c: Cluster, prompt: str) -> httpx.Response:
    r = httpx.post(
        f"{c.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def test_requests_sharing_a_long_prefix_land_on_the_worker_that_holds_it(cluster):
    for i in range(3):  # three prefixes: the first of each is spread over the workers, the second follows it
        first = completion(cluster, CONTEXT.format(i=i) + "Question one: how long is it?")
        second = completion(cluster, CONTEXT.format(i=i) + "Question two: where does it end?")
        a, b = (status(cluster, r.headers["x-request-id"]) for r in (first, second))
        assert b["exec"]["worker_id"] == a["exec"]["worker_id"], (i, a["exec"], b["exec"])
        assert b["exec"]["routing"] == "kv" and b["exec"]["routing_reason"] == "overlap"
        matched = b["exec"]["matched_blocks"]
        assert matched[b["exec"]["worker_id"]] >= 8 and len(matched) == 2
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 8 * 16
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_usage_reports_the_prompt_tokens_served_from_the_cache(cluster):
    def chat(question: str) -> dict:
        r = httpx.post(
            f"{cluster.url}/v1/chat/completions",
            timeout=120,
            json={
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": CONTEXT.format(i="chat")},
                    {"role": "user", "content": question},
                ],
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    assert chat("How long is it?")["prompt_tokens_details"]["cached_tokens"] == 0
    usage = chat("Where does it end?")
    assert 8 * 16 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_generate_usage_reports_the_prompt_tokens_served_from_the_cache(cluster):
    def generate(question: str) -> dict:
        r = httpx.post(
            f"{cluster.url}/generate",
            timeout=120,
            json={"prompt": CONTEXT.format(i="native") + question, "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    assert generate("How long is it?")["cached_tokens"] == 0
    assert generate("Where does it end?")["cached_tokens"] >= 8 * 16
