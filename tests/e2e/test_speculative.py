"""Speculative decoding through the whole pipeline (on by default for greedy requests): a greedy chat answer that
repeats its prompt streams the same text as without drafts, and the workers' draft counters reach /metrics."""

from __future__ import annotations

import httpx

from tests.support.openai_fixtures import MODEL
from tests.support.waiting import wait_for
from tests.support.metrics import scrape

REPEAT = "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."


def _accepted(url: str) -> float:
    return scrape(url).get("conveyor:spec_decode_num_accepted_tokens_total", 0.0)


def test_a_greedy_answer_that_repeats_its_prompt_is_drafted_and_counted(cluster, tokenizer, hf_reference):
    before = _accepted(cluster.url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 48, "temperature": 0}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    prompt = list(
        tokenizer.apply_chat_template([{"role": "user", "content": REPEAT}], add_generation_prompt=True)["input_ids"]
    )
    expected = tokenizer.decode(hf_reference(prompt, 48), skip_special_tokens=True)
    assert (
        r.json()["choices"][0]["message"]["content"] == expected.strip()
        or r.json()["choices"][0]["message"]["content"] == expected
    )
    # the counters come with the worker's next heartbeats
    wait_for(lambda: _accepted(cluster.url) > before, timeout=30, what="accepted drafts counted in /metrics")
