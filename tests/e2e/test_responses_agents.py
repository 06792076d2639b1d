"""An agent loop of the OpenAI Agents SDK (`openai-agents`, its default model class: the Responses API) against
Conveyor, with a function tool: the model is made to call it (tool_choice required), the SDK runs it and sends its
output back, and the run ends with the model's answer. Skipped where the SDK is not installed."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from tests.support.cluster import KEY_A
from tests.support.openai_fixtures import MODEL, async_openai_client

agents = pytest.importorskip("agents")


def test_an_agents_sdk_loop_calls_a_function_tool_and_answers(keyed_cluster):
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    called: list[str] = []

    @agents.function_tool
    def get_current_weather(city: Literal["Paris", "Rome"]) -> str:
        """The current weather in a city."""
        called.append(city)
        return "21 degrees and sunny"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=async_openai_client(keyed_cluster.url, KEY_A))
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_current_weather],
        model=model,
        # required for the first turn only (the SDK resets it to auto once a tool ran), so the loop can end
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert called and called[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
