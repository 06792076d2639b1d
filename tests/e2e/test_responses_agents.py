"""An agent loop of the OpenAI Agents SDK (`openai-agents`, its default model class: the Responses API) against
Conveyor, with a function tool: the model is made to call it (tool_choice required: the simulated engine's output
is then forced into a call by the grammar), the SDK runs it and sends its output back, and the run ends with the
model's answer. The SDK runs in a venv of its own (its websockets pin clashes with ours), made once and cached
(tests/support/peer_venv.py); the test is skipped with the reason where it cannot be installed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import KEY_A, auth
from tests.support.openai_fixtures import MODEL
from tests.support.peer_venv import peer_python

AGENTS = "openai-agents==0.24.0"
LOOP = Path(__file__).resolve().parents[1] / "support" / "agents_loop.py"


@pytest.fixture(scope="module")
def agents_python() -> Path:
    return peer_python("openai-agents", AGENTS)


def test_an_agents_sdk_loop_calls_a_function_tool_and_answers(keyed_cluster, agents_python):
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    ran = subprocess.run(
        [str(agents_python), str(LOOP), f"{keyed_cluster.url}/v1", KEY_A, MODEL],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    run = json.loads(ran.stdout.splitlines()[-1])
    assert run["called"] and set(run["called"]) <= {"Paris", "Rome"}  # the tool itself ran
    assert run["arguments"] and all(json.loads(a) in ({"city": "Paris"}, {"city": "Rome"}) for a in run["arguments"])
    assert run["items"][:2] == ["tool_call_item", "tool_call_output_item"] and run["items"][-1] == "message_output_item"
    assert isinstance(run["final_output"], str)
    for response_id in run["response_ids"]:  # each model call made a stored response, under the caller's key
        got = httpx.get(f"{keyed_cluster.url}/v1/responses/{response_id}", headers=auth(KEY_A), timeout=30)
        assert got.status_code == 200 and got.json()["status"] in ("completed", "incomplete")
