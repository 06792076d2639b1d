"""Log probabilities and OpenAI's presence/frequency penalties end to end, through the official `openai` client
(both APIs, stream and not) and /generate; values against transformers' float32 forward within 1e-3."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from tests.support.openai_fixtures import MODEL

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"
TOL = 1e-3


@pytest.fixture(scope="module")
def hf_logprobs(hf_reference):
    """prompt ids + output ids -> [len(output), V] float64 log-softmax of transformers' float32 logits."""
    model = hf_reference.model

    def compute(prompt: list[int], output: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.double(), dim=-1)

    return compute


def _token_bytes(tok, tid: int) -> bytes:
    from services.gateway.text.logprobs import TokenStrings

    return TokenStrings(tok).raw(tid)


def test_chat_logprobs_are_transformers_log_softmax_and_the_stream_carries_the_same(client, hf_reference, hf_logprobs):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    prompt = hf_reference.prompt_ids(messages=CHAT)
    ids = hf_reference(prompt, 10)
    assert len(content) == len(ids) == whole.usage.completion_tokens
    ref = hf_logprobs(prompt, ids)
    tok = hf_reference.tokenizer
    for j, (tid, entry) in enumerate(zip(ids, content)):
        assert bytes(entry.bytes) == _token_bytes(tok, tid) and entry.token == bytes(entry.bytes).decode()
        assert abs(entry.logprob - ref[j, tid].item()) < TOL, (j, entry.logprob, ref[j, tid].item())
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token  # greedy: the argmax
        top = ref[j].topk(6)
        for i, alt in enumerate(entry.top_logprobs):
            assert abs(alt.logprob - top.values[i].item()) < TOL
            if top.values[i] - top.values[i + 1] > TOL and (i == 0 or top.values[i - 1] - top.values[i] > TOL):
                assert bytes(alt.bytes) == _token_bytes(tok, top.indices[i].item())  # no near-tie: the same token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, content))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_chat_without_logprobs_has_none_and_logprobs_alone_gives_no_alternatives(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    alone = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in alone.choices[0].logprobs.content] == [[], [], []]


def test_completion_logprobs_match_transformers_and_the_stream_carries_the_same(client, hf_reference, hf_logprobs):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    prompt = hf_reference.prompt_ids(PROMPT)
    ids = hf_reference(prompt, 10)
    ref = hf_logprobs(prompt, ids)
    tok = hf_reference.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in ids]
    for j, tid in enumerate(ids):
        assert abs(lp.token_logprobs[j] - ref[j, tid].item()) < TOL
        assert len(lp.top_logprobs[j]) == 3 and lp.top_logprobs[j][lp.tokens[j]] == lp.token_logprobs[j]
        assert whole.text[lp.text_offset[j] :].startswith(lp.tokens[j])
    chunks = list(client.completions.create(**kw, stream=True))
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            for key in merged:
                merged[key] += getattr(c.choices[0].logprobs, key)
    assert merged["tokens"] == lp.tokens and merged["text_offset"] == lp.text_offset
    assert all(abs(a - b) < TOL for a, b in zip(merged["token_logprobs"], lp.token_logprobs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text


def test_sampled_completion_logprobs_are_of_the_tempered_distribution(client, hf_reference, hf_logprobs, cluster):
    """At temperature 0.5 the log probabilities are log_softmax(logits / 0.5) (before top-k/top-p)."""
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0.5,
        "top_k": 20,
        "seed": 3,
        "logprobs": 2,
        "ignore_eos": True,
    }
    out = httpx.post(f"{cluster.url}/generate", json=body, timeout=120).json()
    prompt = hf_reference.prompt_ids(PROMPT)
    ref = hf_logprobs(prompt, out["token_ids"])  # log_softmax(logits) = logits - c: temper it by hand
    for j, (tid, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        tempered = torch.log_softmax(ref[j] / 0.5, dim=-1)
        assert entry["token_id"] == tid and abs(entry["logprob"] - tempered[tid].item()) < TOL
        assert [t["token_id"] for t in entry["top_logprobs"]] == tempered.topk(2).indices.tolist()


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    reference = client.completions.create(**kw, logprobs=1).choices[0]
    stop = reference.text[len(reference.text) // 2 : len(reference.text) // 2 + 3]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(
                    **kw, logprobs=1, stop=[stop], stream=True, stream_options={"include_usage": True}
                )
            )
            tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        else:
            out = client.completions.create(**kw, logprobs=1, stop=[stop])
            tokens, text, usage = out.choices[0].logprobs.tokens, out.choices[0].text, out.usage
        assert text == reference.text[: reference.text.index(stop)]
        assert len(tokens) == usage.completion_tokens < len(reference.logprobs.tokens)
        assert tokens == reference.logprobs.tokens[: len(tokens)]
        assert stop in "".join(tokens) and stop not in "".join(tokens[:-1]), "cut at the token completing the stop"


def test_generate_returns_logprobs_per_token_streamed_or_not(cluster):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = httpx.post(f"{cluster.url}/generate", json=body, timeout=120).json()
    assert [e["token_id"] for e in whole["logprobs"]] == whole["token_ids"]
    assert all(
        e["top_logprobs"][0]["token_id"] == e["token_id"] and len(e["top_logprobs"]) == 2 for e in whole["logprobs"]
    )
    events = []
    with httpx.stream("POST", f"{cluster.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    streamed = [e for ev in events[:-1] for e in ev.get("logprobs", [])]
    assert [e["token_id"] for e in streamed] == whole["token_ids"]
    assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=TOL) for a, b in zip(streamed, whole["logprobs"]))
    plain = httpx.post(f"{cluster.url}/generate", json={**body, "logprobs": None}, timeout=120).json()
    assert "logprobs" not in plain


def test_a_strong_frequency_penalty_stops_the_repetition_greedy_makes(client):
    kw = dict(
        model=MODEL, prompt="one one one one one one one", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    plain = client.completions.create(**kw, logprobs=0).choices[0]
    penalised = client.completions.create(**kw, logprobs=0, frequency_penalty=2.0).choices[0]
    repeats = max(plain.logprobs.tokens.count(t) for t in plain.logprobs.tokens)
    assert repeats >= 4, plain.text  # "-to-many-to-many-to-many-to-many"
    assert max(penalised.logprobs.tokens.count(t) for t in penalised.logprobs.tokens) <= 2, penalised.text
    encouraged = client.completions.create(**kw, presence_penalty=-2.0).choices[0]
    assert encouraged.text == plain.text  # already as repetitive as it gets: a negative presence penalty keeps it
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat the word 'hello' ten times."}],
        max_tokens=16,
        temperature=0,
        presence_penalty=-2.0,
    )
    assert chat.choices[0].message.content.lower().count("hello") >= 5, chat.choices[0].message.content


@pytest.mark.parametrize(
    "api, extra, param",
    [
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ],
)
def test_out_of_range_penalties_and_logprobs_are_400s_naming_the_field(client, api, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if api == "chat":
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_generate_refuses_out_of_range_penalties_and_logprobs(cluster, extra, param):
    r = httpx.post(f"{cluster.url}/generate", json={"prompt": PROMPT, "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
