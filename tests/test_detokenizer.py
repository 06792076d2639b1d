"""Incremental detokenization is exact: the deltas add up to the whole text, even when one character
(an emoji, a Chinese character) is split over several byte-level tokens; no replacement character
appears mid-stream for text that has none, and an output cut in the middle of a character (max_tokens)
ends before it, as vLLM's does: the incomplete character is held back and dropped."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from services.gateway.text.detokenizer import IncrementalDetokenizer
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


def _complete(tokenizer, ids: list[int]) -> str:
    """The text of `ids` without the replacement characters of a character their last tokens leave incomplete."""
    return _decode(tokenizer, ids).rstrip("\ufffd")


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
        assert "".join(_deltas(tokenizer, ids)) == _complete(tokenizer, ids), ids


def test_a_character_cut_short_at_the_end_is_dropped_not_replaced(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if _decode(tokenizer, ids[:k]).endswith("\ufffd"))
    deltas = _deltas(tokenizer, ids[:cut])
    assert "".join(deltas) == "ok " and not any("\ufffd" in d for d in deltas), deltas


# ---- end to end: what the model really emits, through the gateway ----

def _openai_body(body: dict, max_tokens: int) -> tuple[str, dict]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return path, {"model": MODEL, **body, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _text_of(chunk: dict) -> str:
    """The text of a completion, a chat message or a stream chunk of either."""
    choice = chunk["choices"][0]
    message = choice.get("message") or choice.get("delta") or {}
    return choice.get("text") or message.get("content") or ""


async def _three_ways(client: httpx.AsyncClient, body: dict, max_tokens: int = MAX_TOKENS) -> tuple[dict, str, list[str]]:
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
        assert "".join(deltas) == whole == native["text"] == _complete(tokenizer, ids)
        assert any(ord(c) > 0x2E80 for c in whole), whole  # emoji or CJK really came out
        assert not any("\ufffd" in d for d in deltas), deltas
    assert split_seen, "no character was split across tokens: the prompts no longer test what they should"


def test_max_tokens_cutting_a_character_ends_the_text_before_it_streamed_and_whole(cluster, tokenizer):
    """max_tokens chosen to stop inside a character the model emits (found from a longer greedy run)."""
    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=180) as client:
            for body in EMITTING:
                ids = (await client.post("/generate", json={**body, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                            "ignore_eos": True})).json()["token_ids"]
                cuts = [k for k in range(1, len(ids)) if _decode(tokenizer, ids[:k]).endswith("\ufffd")]
                if cuts:
                    return cuts[0], ids, await _three_ways(client, body, max_tokens=cuts[0])
        pytest.fail("no greedy output of EMITTING splits a character: the prompts no longer test what they should")
    cut, ids, (native, whole, deltas) = asyncio.run(run())
    assert native["token_ids"] == ids[:cut]
    assert "".join(deltas) == whole == native["text"] == _complete(tokenizer, ids[:cut])
    assert not whole.endswith("\ufffd") and not any("\ufffd" in d for d in deltas), (whole, deltas)


class _Counting:
    """The real tokenizer, counting how many ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_a_long_run_of_tokens_without_text_is_not_decoded_again_at_every_token(tokenizer):
    """Special tokens decode to nothing: the window must not keep them (it grew by one token per push and every
    push decoded all of it again, quadratic in the run: 2,000 tokens cost 4 million decoded ids)."""
    counting = _Counting(tokenizer)
    d = IncrementalDetokenizer(counting)
    eos, n = tokenizer.eos_token_id, 2000
    out = [d.push([eos]) for _ in range(n)] + [d.push(tokenizer.encode(" done", add_special_tokens=False)), d.flush()]
    assert "".join(out) == " done"
    assert counting.decoded < 10 * n
