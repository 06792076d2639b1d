"""The control plane over simulated workers: every process is the real one (gateway, tokenizer,
scheduler, Redis) except that the workers run CONVEYOR_ENGINE=sim. Existing pipeline and cancel tests
that do not depend on the model's numbers are collected here again, against the simulator (their
fixtures are this module's); what they compare tokens with is what the simulator emits for the prompt
(`hf_reference` below). The request-path, fault, shutdown and takeover tests run on simulated workers in
their own modules (tests/e2e/test_request_paths.py, test_faults.py, test_shutdown.py, test_takeover.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from tests.support.openai_fixtures import MODEL
from tests.support.sim_reference import sim_greedy

# The existing tests collected again here, against simulated workers (noqa: imported to be collected).
from tests.e2e.test_cancel import (  # noqa: F401
    test_client_disconnect_mid_stream_cancels_request,
    test_client_disconnect_mid_stream_releases_the_gateway_handle,
    test_delete_while_decoding_cancels_and_frees_blocks,
)
from tests.e2e.test_pipeline import (  # noqa: F401
    test_request_status_shows_state_history_and_all_layers,
    test_response_carries_usage_and_metrics,
    test_sixteen_concurrent_streams_finish_and_match_non_stream_text,
)


@pytest.fixture(scope="module", autouse=True)
def sim_workers():
    """Every cluster of this module (the imported tests build their own from the environment) gets simulated
    workers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_ENGINE", "sim")
        yield


@pytest.fixture(scope="module")
def cluster(sim_cluster):
    """The session's simulated cluster, as the imported tests' `cluster`."""
    return sim_cluster


@pytest.fixture(scope="module")
def hf_reference(model_dir: Path):
    """Stands in for the model's greedy reference: the tokens the simulator emits for a prompt (greedy, no EOS)."""
    return sim_greedy(model_dir)


def test_sim_worker_loads_neither_torch_nor_the_weights(cluster):
    maps = Path(f"/proc/{cluster.procs['worker0'].pid}/maps").read_text()
    assert "libtorch" not in maps and "safetensors" not in maps


def test_simulated_stream_has_contiguous_indices_and_the_text_of_its_tokens(cluster, hf_reference):
    body = {"prompt": "Tell me a story", "max_tokens": 32, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{cluster.url}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    deltas, final = events[:-1], events[-1]
    assert [e["index"] for e in deltas] == list(range(32)) and final["finish_reason"] == "length"
    ids = [t for e in deltas for t in e["token_ids"]]
    assert ids == hf_reference(hf_reference.prompt_ids("Tell me a story"), 32)
    assert "".join(e["text"] for e in deltas) == hf_reference.tokenizer.decode(ids)


def test_stop_strings_cut_simulated_text(cluster):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    full = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    words = full["text"].split(" ")
    stop = " " + words[4]
    cut = httpx.post(f"{cluster.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]


def test_same_prompt_and_seed_give_the_same_simulated_text(cluster):
    body = {"prompt": "Pick some words", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    first = httpx.post(f"{cluster.url}/generate", json=body, timeout=60).json()
    again = httpx.post(f"{cluster.url}/generate", json=body, timeout=60).json()
    other = httpx.post(f"{cluster.url}/generate", json={**body, "seed": 12}, timeout=60).json()
    assert first["token_ids"] == again["token_ids"] and first["text"] == again["text"]
    assert other["token_ids"] != first["token_ids"]


def test_simulated_logprobs_reach_the_openai_client(cluster):
    """Synthetic (SimVocab.logprobs): with no EOS chance the emitted word is the mode, at probability 1/2."""
    from tests.support.openai_fixtures import openai_client

    out = openai_client(cluster.url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say words"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert abs(e.logprob - math.log(0.5)) < 1e-6 and [t.token for t in e.top_logprobs][0] == e.token
        assert abs(e.top_logprobs[1].logprob - math.log(0.25)) < 1e-6
