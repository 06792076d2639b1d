"""What the model really emits, through the gateway: the streamed and whole texts of emoji and Chinese output are
exact, and a max_tokens cut inside a character ends before it (the detokenizer alone: unit/test_detokenizer.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.support.openai_fixtures import MODEL
from tests.unit.test_detokenizer import _complete, _decode

# Prompts the model answers with emoji or Chinese (greedy): several byte-level tokens per character.
EMITTING = [
    {"prompt": "😀😀😀 Emoji party: 🎉"},
    {"prompt": "你好，世界！我们今天"},
    {"messages": [{"role": "user", "content": "Translate to Chinese: I love my family."}]},
]
MAX_TOKENS = 16


def _openai_body(body: dict, max_tokens: int) -> tuple[str, dict]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return path, {"model": MODEL, **body, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _text_of(chunk: dict) -> str:
    """The text of a completion, a chat message or a stream chunk of either."""
    choice = chunk["choices"][0]
    message = choice.get("message") or choice.get("delta") or {}
    return choice.get("text") or message.get("content") or ""


async def _three_ways(
    client: httpx.AsyncClient, body: dict, max_tokens: int = MAX_TOKENS
) -> tuple[dict, str, list[str]]:
    """The native answer (token ids), the OpenAI non-stream text and the OpenAI stream deltas."""
    path, oa = _openai_body(body, max_tokens)

    async def stream() -> list[str]:
        deltas = []
        async with client.stream("POST", path, json={**oa, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and (chunk := json.loads(line[6:]))["choices"]:
                    deltas.append(_text_of(chunk))
        return deltas

    native, whole, deltas = await asyncio.gather(
        client.post("/generate", json={**body, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}),
        client.post(path, json=oa),
        stream(),
    )
    return native.json(), _text_of(whole.json()), deltas


def test_stream_text_equals_non_stream_text_for_emoji_and_chinese(cluster, tokenizer):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as client:
            return await asyncio.gather(*[_three_ways(client, b) for b in EMITTING])

    split_seen = False
    for native, whole, deltas in asyncio.run(run()):
        ids = native["token_ids"]
        split_seen |= any("\ufffd" in tokenizer.decode([t]) for t in ids)
        assert "".join(deltas) == whole == native["text"] == _complete(tokenizer, ids)
        assert any(ord(c) > 0x2E80 for c in whole), whole  # emoji or CJK really came out
        assert not any("\ufffd" in d for d in deltas), deltas
    assert split_seen, "no character was split across tokens: the prompts no longer test what they should"


def test_max_tokens_cutting_a_character_ends_the_text_before_it_streamed_and_whole(cluster, tokenizer):
    """max_tokens chosen to stop inside a character the model emits (found from a longer greedy run)."""

    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as client:
            for body in EMITTING:
                ids = (
                    await client.post(
                        "/generate", json={**body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                    )
                ).json()["token_ids"]
                cuts = [k for k in range(1, len(ids)) if _decode(tokenizer, ids[:k]).endswith("\ufffd")]
                if cuts:
                    return cuts[0], ids, await _three_ways(client, body, max_tokens=cuts[0])
        pytest.fail("no greedy output of EMITTING splits a character: the prompts no longer test what they should")

    cut, ids, (native, whole, deltas) = asyncio.run(run())
    assert native["token_ids"] == ids[:cut]
    assert "".join(deltas) == whole == native["text"] == _complete(tokenizer, ids[:cut])
    assert not whole.endswith("\ufffd") and not any("\ufffd" in d for d in deltas), (whole, deltas)
