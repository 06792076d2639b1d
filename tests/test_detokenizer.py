"""Incremental detokenization is exact: the deltas add up to the whole text, even when one character
(an emoji, a Chinese character) is split over several byte-level tokens; no replacement character
appears mid-stream for text that has none."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from services.gateway.detokenizer import IncrementalDetokenizer
from shared.tokenization import load_tokenizer
from tests.openai_fixtures import MODEL

SAMPLES = ["Hello 😀 world 你好，世界! 🎉🎉 naïve café — “quotes” 👨‍👩‍👧", "日本語のテキスト。한국어도. العربية",
           " leading  spaces\n\nnew\tlines  "]
# Prompts the model answers with emoji or Chinese (greedy): several byte-level tokens per character.
EMITTING = [{"prompt": "😀😀😀 Emoji party: 🎉"}, {"prompt": "你好，世界！我们今天"},
            {"messages": [{"role": "user", "content": "Translate to Chinese: I love my family."}]}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _deltas(tokenizer, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tokenizer)
    return [d.push([t]) for t in ids] + [d.flush()]


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_multibyte_text_token_by_token_equals_whole_decode_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _deltas(tokenizer, ids)
    assert "".join(deltas) == _decode(tokenizer, ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_token_sequences_add_up_to_the_whole_decode(tokenizer):
    rng = random.Random(0)
    # Tokens that are pieces of a character (alone they decode to U+FFFD) are the hard case: favour them.
    pieces = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    special = list(tokenizer.all_special_ids)
    for _ in range(500):
        ids = [rng.choice(pieces) if rng.random() < 0.5 else
               rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 30))]
        assert "".join(_deltas(tokenizer, ids)) == _decode(tokenizer, ids), ids


# ---- end to end: what the model really emits, through the gateway ----

def _openai_body(body: dict) -> tuple[str, dict]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return path, {"model": MODEL, **body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def _text_of(chunk: dict) -> str:
    """The text of a completion, a chat message or a stream chunk of either."""
    choice = chunk["choices"][0]
    message = choice.get("message") or choice.get("delta") or {}
    return choice.get("text") or message.get("content") or ""


async def _three_ways(client: httpx.AsyncClient, body: dict) -> tuple[dict, str, list[str]]:
    """The native answer (token ids), the OpenAI non-stream text and the OpenAI stream deltas."""
    path, oa = _openai_body(body)

    async def stream() -> list[str]:
        deltas = []
        async with client.stream("POST", path, json={**oa, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and (chunk := json.loads(line[6:]))["choices"]:
                    deltas.append(_text_of(chunk))
        return deltas

    native, whole, deltas = await asyncio.gather(
        client.post("/generate", json={**body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}),
        client.post(path, json=oa), stream())
    return native.json(), _text_of(whole.json()), deltas


def test_stream_text_equals_non_stream_text_for_emoji_and_chinese(cluster, tokenizer):
    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as client:
            return await asyncio.gather(*[_three_ways(client, b) for b in EMITTING])
    split_seen = False
    for native, whole, deltas in asyncio.run(run()):
        ids = native["token_ids"]
        split_seen |= any("\ufffd" in tokenizer.decode([t]) for t in ids)
        assert "".join(deltas) == whole == native["text"] == _decode(tokenizer, ids)
        assert any(ord(c) > 0x2E80 for c in whole), whole  # emoji or CJK really came out
        # Only the very end may hold a character cut short by max_tokens.
        assert not any("\ufffd" in d for d in deltas[:-2]), deltas
    assert split_seen, "no character was split across tokens: the prompts no longer test what they should"
