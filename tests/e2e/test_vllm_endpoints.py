"""What vLLM serves besides generation, on the session's simulated cluster (the tokenizer is the served model's
whatever engine runs): POST /tokenize and /detokenize in vLLM's shapes (ids, counts, strings, and the count a chat
request is charged), X-Request-Id on every response, GET /version."""

from __future__ import annotations

import httpx
import pytest

from tests.support.openai_fixtures import MODEL
from tests.support.waiting import wait_for

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def cluster(sim_cluster):
    return sim_cluster


def post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=30)


def test_tokenize_a_prompt_gives_its_ids_their_count_and_the_context_window(cluster, tokenizer):
    r = post(cluster, "/tokenize", {"model": MODEL, "prompt": "Hello there, world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello there, world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0 and body["token_strs"] is None


def test_tokenize_messages_counts_what_a_chat_request_is_charged(cluster):
    counted = post(cluster, "/tokenize", {"messages": MESSAGES}).json()["count"]
    chat = post(cluster, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    assert counted == chat["usage"]["prompt_tokens"]


def test_token_strings_come_back_when_asked(cluster, tokenizer):
    body = post(cluster, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_detokenize_gives_back_the_text_of_the_ids(cluster):
    ids = post(cluster, "/tokenize", {"prompt": "Hello there, world", "add_special_tokens": False}).json()["tokens"]
    assert post(cluster, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": "Hello there, world"}


def test_an_id_beyond_the_vocabulary_is_a_400_naming_tokens(cluster):
    r = post(cluster, "/detokenize", {"tokens": [1, 10_000_000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("body", [{"prompt": "x", "messages": MESSAGES}, {}], ids=["both", "neither"])
def test_tokenize_takes_exactly_one_of_prompt_or_messages(cluster, body):
    r = post(cluster, "/tokenize", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_tokenize_for_another_model_is_a_404(cluster):
    r = post(cluster, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_every_response_carries_an_x_request_id_echoing_the_clients(cluster):
    assert httpx.get(f"{cluster.url}/health").headers["x-request-id"]
    assert httpx.get(f"{cluster.url}/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    refused = post(cluster, "/tokenize", {})
    assert refused.status_code == 400 and refused.headers["x-request-id"]
    chat = post(cluster, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert chat.headers["x-request-id"] == chat.json()["id"].removeprefix("chatcmpl-")  # a generation's: its id


def test_version_answers_the_servers_version(cluster):
    assert httpx.get(f"{cluster.url}/version").json()["version"]


def _scrape(cluster) -> str:
    return httpx.get(f"{cluster.url}/metrics", timeout=10).text


def _sample(text: str, name: str) -> float:
    """The value of one exposition line `name` (with its labels) of a scrape."""
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_have_vllms_per_request_token_and_parameter_histograms(cluster):
    before = _scrape(cluster)
    body = {"model": MODEL, "prompt": "Count with me: one two three", "max_tokens": 5, "n": 2}
    assert post(cluster, "/v1/completions", body).status_code == 200
    counted = "conveyor:request_generation_tokens_count"

    # Observed as each choice is released (once its answer is out): waited for, not assumed.
    def counted_both() -> str | None:
        text = _scrape(cluster)
        return text if _sample(text, counted) >= _sample(before, counted) + 2 else None

    after = wait_for(counted_both, 10, what="both choices counted")

    def grew(name: str) -> float:
        return _sample(after, name) - _sample(before, name)

    # Each choice is one finished request of 5 tokens; the request's parameters are observed once.
    assert grew("conveyor:request_generation_tokens_count") == 2
    assert grew('conveyor:request_generation_tokens_bucket{le="5.0"}') == 2
    assert grew("conveyor:request_prompt_tokens_count") == 2
    assert grew("conveyor:request_params_n_count") == 1 and grew('conveyor:request_params_n_bucket{le="1.0"}') == 0
    assert grew('conveyor:request_params_max_tokens_bucket{le="5.0"}') == 1


def test_metrics_have_the_waiting_requests_by_reason_and_the_cache_config(cluster):
    text = _scrape(cluster)
    assert _sample(text, 'conveyor:num_requests_waiting_by_reason{reason="queued"}') >= 0
    assert _sample(text, 'conveyor:num_requests_waiting_by_reason{reason="capacity"}') >= 0
    info = [line for line in text.splitlines() if line.startswith("conveyor:cache_config_info{")]
    assert info and all('block_size="16"' in line and "num_blocks=" in line for line in info)


def test_tokenizer_info_gives_the_tokenizers_class_template_and_special_tokens(cluster, tokenizer):
    info = httpx.get(f"{cluster.url}/tokenizer_info", timeout=10).json()
    models = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and info["vocab_size"] == len(tokenizer)
    assert info["model_max_length"] == models["max_model_len"]


def test_load_counts_the_requests_this_gateway_is_serving(cluster):
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):  # its first tokens came: its request is in flight here
            pass
        assert httpx.get(f"{cluster.url}/load", timeout=10).json()["server_load"] >= 1
    wait_for(lambda: httpx.get(f"{cluster.url}/load", timeout=10).json()["server_load"] == 0, 15, what="released")
