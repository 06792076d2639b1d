"""Assistant prefill on the real model through the official `openai` client: a chat with continue_final_message
answers exactly what the model writes after the rendered conversation given as a raw completion prompt (the last
assistant message continued, no new turn opened)."""

from __future__ import annotations

import httpx

from tests.support.openai_fixtures import MODEL

PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "My favourite colour is"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_a_continued_message_is_the_raw_completion_of_its_rendered_prompt(cluster, client):
    chat = client.chat.completions.create(
        model=MODEL, messages=PREFILL, max_tokens=12, temperature=0, extra_body=CONTINUE
    )
    ids = httpx.post(f"{cluster.url}/tokenize", json={"messages": PREFILL, **CONTINUE}, timeout=60).json()["tokens"]
    prompt = httpx.post(f"{cluster.url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert chat.choices[0].message.content == raw.choices[0].text and raw.choices[0].text
