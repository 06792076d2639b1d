"""/v1/completions' prompt lists through the official `openai` client against the session's simulated cluster (the
model's numbers do not matter: the simulated output is a function of prompt and seed): one choice per prompt and
sample, numbered as OpenAI (prompt i, sample j: index i*n + j), each the answer its prompt alone gets; one usage
summing every prompt; token-id prompts skip the encoding and are checked."""

from __future__ import annotations

import httpx
import pytest

from tests.support.openai_fixtures import MODEL, openai_client

PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def sim_client(sim_cluster):
    return openai_client(sim_cluster.url)


def _alone(client, prompt, **kw) -> list:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=3, **kw).choices


def _texts(choices) -> dict[int, str]:
    return {c.index: c.text for c in choices}


@pytest.mark.parametrize("n", [1, 2])
def test_a_prompt_list_answers_each_prompt_as_it_alone_at_openais_index(sim_client, n):
    out = sim_client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, seed=3, n=n)
    assert sorted(c.index for c in out.choices) == list(range(len(PROMPTS) * n))
    got = _texts(out.choices)
    for i, prompt in enumerate(PROMPTS):
        alone = _texts(_alone(sim_client, prompt, n=n))
        assert [got[i * n + j] for j in range(n)] == [alone[j] for j in range(n)], prompt


def test_a_prompt_lists_usage_sums_every_prompt_and_every_choice(sim_client):
    out = sim_client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, seed=3, n=2)
    alone = [sim_client.completions.create(model=MODEL, prompt=p, max_tokens=6, seed=3, n=2).usage for p in PROMPTS]
    assert out.usage.prompt_tokens == sum(u.prompt_tokens for u in alone)
    assert out.usage.completion_tokens == sum(u.completion_tokens for u in alone)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_streamed_prompt_list_gives_the_same_choices(sim_client):
    whole = _texts(sim_client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, seed=3, n=2).choices)
    streamed: dict[int, str] = {}
    finished = set()
    stream = sim_client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, seed=3, n=2, stream=True, stream_options={"include_usage": True}
    )
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert streamed == whole and finished == set(whole)
    assert usage is not None and usage.prompt_tokens > 0


def test_token_id_prompts_answer_as_their_text(sim_client, sim_cluster):
    ids = [httpx.post(f"{sim_cluster.url}/tokenize", json={"prompt": p}, timeout=30).json()["tokens"] for p in PROMPTS]
    by_text = _texts(sim_client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, seed=3).choices)
    by_ids = sim_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, seed=3)
    assert _texts(by_ids.choices) == by_text
    assert by_ids.usage.prompt_tokens == sum(len(x) for x in ids)
    one = sim_client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, seed=3)
    assert one.choices[0].text == by_text[0]


@pytest.mark.parametrize(
    "prompt, param",
    [
        ([], "prompt"),
        (["a", ""], "prompt.1"),
        ([[1, 2], []], "prompt.1"),
        ([10**8], "prompt"),
        ([[5], [10**8]], "prompt"),
        ([1] * 10_000, "prompt"),
        (["a"] * 65, "prompt"),
    ],
    ids=[
        "empty_list",
        "empty_string",
        "empty_ids",
        "id_beyond_vocab",
        "listed_id_beyond_vocab",
        "too_long",
        "too_many",
    ],
)
def test_a_bad_prompt_list_is_a_400_naming_the_prompt(sim_cluster, prompt, param):
    r = httpx.post(
        f"{sim_cluster.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_prompts_times_n_beyond_the_limit_is_a_400(sim_cluster):
    body = {"model": MODEL, "prompt": ["a"] * 5, "n": 16, "max_tokens": 2}
    r = httpx.post(f"{sim_cluster.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
