"""Stop strings through the gateway on the real model's greedy output: cut before the stop, streamed or whole, and the
worker freed (the matcher itself: tests/unit/test_stop_strings.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_fixtures import MODEL, request_id, snapshot, worker_idle
from tests.support.waiting import wait_for
from tests.unit.test_stop_strings import _assert_never_ahead, _offsets, _spanning

PROMPT = "Once upon a time, in a land far away,"
MAX_TOKENS = 24


def _greedy(cluster, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=180)


def _stream_deltas(cluster, **extra) -> tuple[list[str], str, str]:
    """The text deltas, the finish_reason and the response id of a streamed completion."""
    deltas, finish, rid = [], None, ""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                deltas.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
    return deltas, finish, rid


@pytest.fixture(scope="module")
def reference(cluster, tokenizer) -> tuple[str, list[int]]:
    """The greedy output's text and the character offset where each of its tokens starts."""
    r = httpx.post(
        f"{cluster.url}/generate",
        json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=180,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    return out["text"], _offsets(tokenizer, out["token_ids"])


def test_stream_with_stop_spanning_two_tokens_ends_before_it_and_frees_the_worker(cluster, reference):
    text, offsets = reference
    stop, _ = _spanning(text, offsets, 2, start=4)
    deltas, finish, rid = _stream_deltas(cluster, stop=stop)
    assert finish == "stop"
    _assert_never_ahead(deltas, text[: text.index(stop)])
    snap = snapshot(cluster.url, request_id(rid))
    assert snap["state"] == "FINISHED" and snap["history"][-1]["reason"] == "stop_string"
    assert snap["history"][-1]["service"] == "gateway"
    wait_for(lambda: worker_idle(cluster), 30, what="the worker stopped and freed the request's blocks")
    output = snapshot(cluster.url, request_id(rid))["output"]  # a worker that ran on would have overwritten it
    assert output["finish_reason"] == "stop" and len(output["token_ids"]) < MAX_TOKENS


def test_stop_spanning_three_tokens_non_stream(cluster, reference):
    text, offsets = reference
    stop, first = _spanning(text, offsets, 3, start=6)
    out = _greedy(cluster, stop=[stop, "\u2603never\u2603"]).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == text[: text.index(stop)]
    assert out["usage"]["completion_tokens"] == first + 3


def test_stop_string_that_never_completes_releases_its_prefix_at_the_end(cluster, reference):
    text, _ = reference
    tail = text[-2:]
    deltas, finish, _ = _stream_deltas(cluster, stop=tail + "\u2603")
    assert finish == "length"
    assert "".join(deltas) == text
    assert deltas[-2:] == [tail, ""]  # held back while it could still become the stop string, released at the end
