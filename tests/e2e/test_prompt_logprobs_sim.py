"""Prompt log probabilities through the gateway, on the shared simulated cluster (its values are the simulator's,
deterministic: SimVocab.prompt_logprob): /generate's prompt_logprobs, completions' echo (with and without logprobs,
max_tokens 0, streamed) and vLLM's prompt_logprobs field on completions and chat."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.openai_fixtures import MODEL

PROMPT = "The history of the printing press begins in the fifteenth century"


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def _post(cluster, path: str, **body) -> dict:
    r = httpx.post(f"{cluster.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _events(cluster, path: str, **body) -> list[dict]:
    out = []
    with httpx.stream("POST", f"{cluster.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _check_vllm_shape(got: list, ids: list[int], vocab, k: int) -> None:
    """None first, then per token {id: {logprob, rank, decoded_token}}: the token's own entry, then its k most
    likely, as the simulator gives them."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        logprob, top_ids, top_lps, rank = vocab.prompt_logprob(ids[p - 1], p, ids[p], k)
        own = got[p][str(ids[p])]
        assert own["rank"] == rank and own["logprob"] == pytest.approx(logprob, abs=1e-6)
        assert set(got[p]) == {str(ids[p]), *map(str, top_ids)}
        for r, (t, v) in enumerate(zip(top_ids, top_lps), 1):
            if t != ids[p]:
                assert got[p][str(t)]["rank"] == r and got[p][str(t)]["logprob"] == pytest.approx(v, abs=1e-6)


def test_generate_gives_prompt_logprobs_in_vllms_shape_whole_and_in_the_first_event(sim_cluster, ids, vocab):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 3}
    whole = _post(sim_cluster, "/generate", **body)
    assert whole["prompt_token_ids"] == ids
    _check_vllm_shape(whole["prompt_logprobs"], ids, vocab, 3)
    assert whole["prompt_logprobs"][1][str(ids[1])]["decoded_token"]
    events = _events(sim_cluster, "/generate", **body)
    carrying = [e for e in events if "prompt_logprobs" in e]
    assert (
        len(carrying) == 1 and carrying[0] is events[0] and carrying[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    )
    assert "prompt_logprobs" not in _post(sim_cluster, "/generate", prompt=PROMPT, max_tokens=2)


def test_completions_echo_with_logprobs_covers_the_prompt_then_the_output(sim_cluster, ids, vocab):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    choice = _post(sim_cluster, "/v1/completions", **body)["choices"][0]
    plain = _post(sim_cluster, "/v1/completions", **{**body, "echo": False})["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 3 and lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(vocab.prompt_logprob(ids[p - 1], p, ids[p], 2)[0], abs=1e-6)
        assert len(lp["top_logprobs"][p]) in (2, 3)  # its 2 most likely, and itself
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    _check_vllm_shape(choice["prompt_logprobs"], ids, vocab, 2)
    chunks = _events(sim_cluster, "/v1/completions", **body)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    streamed = [
        t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    assert streamed == lp["tokens"]


def test_completions_echo_without_logprobs_and_with_max_tokens_zero(sim_cluster, ids):
    base = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "echo": True}
    echoed = _post(sim_cluster, "/v1/completions", **base, max_tokens=3)["choices"][0]
    assert echoed["text"].startswith(PROMPT) and len(echoed["text"]) > len(PROMPT) and echoed["logprobs"] is None
    only = _post(sim_cluster, "/v1/completions", **base, max_tokens=0, logprobs=1)["choices"][0]
    assert only["text"] == PROMPT and len(only["logprobs"]["tokens"]) == len(ids)
    assert (
        "".join(
            c["choices"][0]["text"]
            for c in _events(sim_cluster, "/v1/completions", **base, max_tokens=0)
            if c["choices"]
        )
        == PROMPT
    )


def test_echo_of_token_id_prompts_and_prompt_lists_is_each_prompts_text_and_logprobs(sim_cluster, ids, tokenizer):
    """What lm-eval sends by default: token-id prompts (a list of them), echo, logprobs, max_tokens 0."""
    other = tokenizer.encode("A second, shorter prompt")
    body = {"model": MODEL, "prompt": [ids, other], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    choices = _post(sim_cluster, "/v1/completions", **body)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, prompt in zip(choices, (ids, other)):
        alone = _post(sim_cluster, "/v1/completions", **{**body, "prompt": tokenizer.decode(prompt)})["choices"][0]
        assert choice["text"] == tokenizer.decode(prompt) == alone["text"]
        assert choice["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
        assert len(choice["logprobs"]["tokens"]) == len(prompt) and choice["logprobs"]["token_logprobs"][0] is None


def test_chat_gives_vllms_prompt_logprobs_field(sim_cluster, vocab):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "prompt_logprobs": 1}
    out = _post(sim_cluster, "/v1/chat/completions", **body)
    got = out["choices"][0]["prompt_logprobs"]
    assert len(got) == out["usage"]["prompt_tokens"] and got[0] is None
    assert all(len(entry) in (1, 2) for entry in got[1:])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/generate", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_out_of_range_prompt_logprobs_or_max_tokens_zero_without_echo_are_a_400_naming_them(
    sim_cluster, path, body, param
):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": PROMPT}
    r = httpx.post(
        f"{sim_cluster.url}{path}",
        json={"model": MODEL, **prompt, **body} if path != "/generate" else {**prompt, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
