"""n > 1 choices through the official `openai` client, over two simulated workers (the model's numbers do not
matter here; the engine-level proof that the prompt is computed once is tests/engine/test_engine_choices.py)."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest
import redis

from shared.wire.constants import Names
from tests.support.cluster import cluster_fixture
from tests.support.openai_fixtures import MODEL, request_id, worker_idle
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

N = 4
# Long enough to span several KV blocks (16 tokens each): the choices after the first reuse all but the last.
PROMPT = "Once upon a time, in a village between two rivers, there lived " + "a careful old miller and " * 12
CHAT = [{"role": "user", "content": PROMPT}]
LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}


cluster = cluster_fixture("choices", workers=2, env=SIM)


@pytest.fixture(scope="module")
def r(cluster):
    client = redis.Redis.from_url(cluster.redis.url, decode_responses=True)
    yield client
    client.close()


def _members(r, cluster, rid: str) -> list[str]:
    return json.loads(r.hget(Names(cluster.ns).layer(rid, "meta"), "group_members"))


def _value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:  # the lifecycle's own fields (state, reason) are plain strings
        return raw


def _layer(r, cluster, rid: str, layer: str) -> dict:
    return {k: _value(v) for k, v in r.hgetall(Names(cluster.ns).layer(rid, layer)).items()}


def _create(client, chat: bool, **kw):
    if chat:
        return client.chat.completions.create(model=MODEL, messages=CHAT, **kw)
    return client.completions.create(model=MODEL, prompt=PROMPT, **kw)


def _text(choice, chat: bool) -> str:
    return choice.message.content if chat else choice.text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_have_distinct_indices_and_usage_counts_the_prompt_once(client, chat):
    out = _create(client, chat, n=N, max_tokens=8, seed=7)
    assert [c.index for c in out.choices] == list(range(N))
    assert len({_text(c, chat) for c in out.choices}) == N  # seed + index per choice: they differ
    alone = _create(client, chat, n=1, max_tokens=8, seed=7)
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens
    assert out.usage.completion_tokens == N * 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + N * 8


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_choices_carry_their_index_and_match_the_non_stream_answer(client, chat):
    texts, finishes, usage = defaultdict(str), {}, None
    for chunk in _create(client, chat, n=N, max_tokens=8, seed=11, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    whole = _create(client, chat, n=N, max_tokens=8, seed=11)
    assert dict(texts) == {c.index: _text(c, chat) for c in whole.choices}
    assert finishes == {i: "length" for i in range(N)}
    assert usage.completion_tokens == N * 8 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_seed_gives_the_same_choices_again_and_choice_0_is_the_n_1_answer(client):
    first = _create(client, False, n=N, max_tokens=8, seed=3)
    again = _create(client, False, n=N, max_tokens=8, seed=3)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text == _create(client, False, max_tokens=8, seed=3).choices[0].text


@pytest.mark.parametrize("repeat", [1, 40], ids=["short", "long"])  # long: prefilled in chunks, over several steps
def test_choices_run_on_one_worker_and_reuse_the_first_ones_prompt_blocks(client, cluster, r, repeat):
    out = client.completions.create(model=MODEL, prompt=PROMPT * repeat, n=N, max_tokens=4, seed=5)
    ids = _members(r, cluster, request_id(out.id))
    assert ids[0] == request_id(out.id) and len(ids) == N
    workers = {_layer(r, cluster, rid, "exec")["worker_id"] for rid in ids}
    assert len(workers) == 1
    prompt = _layer(r, cluster, ids[0], "input")["prompt_tokens"]
    cached = [_layer(r, cluster, rid, "kv").get("cached_tokens", 0) for rid in ids]
    assert max(cached[1:]) == min(cached[1:]) == (prompt - 1) // 16 * 16 > 0  # all blocks but the last, reused
    assert [_layer(r, cluster, rid, "meta")["choice_index"] for rid in ids] == list(range(N))


def _states(r, cluster, ids: list[str]) -> list[str]:
    return [_layer(r, cluster, rid, "meta").get("state") for rid in ids]


def test_delete_of_the_request_cancels_every_choice(client, cluster, r):
    stream = _create(client, True, n=N, stream=True, **LONG)
    rid = request_id(next(iter(stream)).id)
    ids = _members(r, cluster, rid)
    answer = httpx.delete(f"{cluster.url}/v1/requests/{rid}", timeout=10)
    assert answer.status_code == 200 and answer.json()["cancelled"] is True
    wait_for(lambda: _states(r, cluster, ids) == ["CANCELLED"] * N, 30, what="every choice cancelled")
    with pytest.raises(openai.APIError):  # the stream ends with the cancel's error
        for _ in stream:
            pass
    wait_for(lambda: worker_idle(cluster), 30, what="the workers released every block")


def test_client_disconnect_cancels_every_choice(client, cluster, r):
    stream = _create(client, False, n=N, stream=True, **LONG)
    rid = request_id(next(iter(stream)).id)
    ids = _members(r, cluster, rid)
    stream.close()
    wait_for(lambda: _states(r, cluster, ids) == ["CANCELLED"] * N, 30, what="every choice cancelled")
    assert {_layer(r, cluster, i, "meta").get("reason") for i in ids} == {"client_disconnect"}
    wait_for(lambda: worker_idle(cluster), 30, what="the workers released every block")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_more_than_16_choices_is_a_400_naming_n_and_the_limit(client, chat):
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, chat, n=17, max_tokens=2)
    assert e.value.param == "n" and "16" in e.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_choices_of_a_prompt_too_long_fail_as_one_400(client, cluster, r, stream):
    with pytest.raises(openai.BadRequestError) as e:
        out = client.completions.create(model=MODEL, prompt="word " * 9000, n=N, max_tokens=4, stream=stream)
        list(out) if stream else None
    assert e.value.code == "too_long"
    rid = e.value.response.headers["x-request-id"]
    wait_for(
        lambda: all(s in ("FAILED", "CANCELLED") for s in _states(r, cluster, _members(r, cluster, rid))),
        30,
        what="every choice ended",
    )


def test_native_generate_with_n_returns_each_choice_and_the_requests_usage(cluster):
    body = {"prompt": PROMPT, "n": N, "max_tokens": 6, "seed": 21}
    out = httpx.post(f"{cluster.url}/generate", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == list(range(N))
    assert out["choices"][0]["request_id"] == out["request_id"]
    assert len({c["text"] for c in out["choices"]}) == N
    assert out["usage"]["completion_tokens"] == N * 6
    assert out["usage"]["prompt_tokens"] == out["choices"][0]["usage"]["prompt_tokens"]


def test_native_stream_with_n_tags_each_event_with_its_choice_then_sends_the_usage(cluster):
    body = {"prompt": PROMPT, "n": N, "max_tokens": 6, "seed": 21}
    whole = httpx.post(f"{cluster.url}/generate", json=body, timeout=60).json()
    texts, finals = defaultdict(str), {}
    with httpx.stream("POST", f"{cluster.url}/generate", json={**body, "stream": True}, timeout=60) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    for ev in events[:-1]:
        texts[ev["choice"]] += ev["text"]
        if "finish_reason" in ev:
            finals[ev["choice"]] = ev["finish_reason"]
    last = events[-1]
    assert dict(texts) == {c["index"]: c["text"] for c in whole["choices"]}
    assert finals == {i: "length" for i in range(N)}
    assert last["usage"] == whole["usage"] | {"cached_tokens": last["usage"]["cached_tokens"]}


def test_native_generate_with_more_than_16_choices_is_a_400_naming_n(cluster):
    answer = httpx.post(f"{cluster.url}/generate", json={"prompt": PROMPT, "n": 17, "max_tokens": 2}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "n" and "16" in error["message"]


def test_a_stop_string_ends_each_choice_at_it(client, cluster, r):
    reference = (
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], n=3, extra_body={"ignore_eos": True}
    )
    assert [(c.text, c.finish_reason) for c in out.choices] == [(reference[: reference.index(stop)], "stop")] * 3
    ids = _members(r, cluster, request_id(out.id))
    assert {_layer(r, cluster, i, "meta")["reason"] for i in ids} == {"stop_string"}


def _logprob_tokens(choice, chat: bool) -> list[str]:
    return [e.token for e in choice.logprobs.content] if chat else choice.logprobs.tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_choice_carries_its_own_logprobs_streamed_as_whole(client, chat):
    asked = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    whole = _create(client, chat, n=N, max_tokens=8, seed=5, **asked)
    streamed = defaultdict(list)
    for chunk in _create(client, chat, n=N, max_tokens=8, seed=5, stream=True, **asked):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed[c.index] += _logprob_tokens(c, chat)
    for c in whole.choices:
        tokens = _logprob_tokens(c, chat)
        assert len(tokens) == 8 and "".join(tokens) == _text(c, chat)
        assert streamed[c.index] == tokens
