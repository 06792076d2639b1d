"""An agent loop of the OpenAI Agents SDK against Conveyor, run by tests/e2e/test_responses_agents.py in the SDK's
own venv (tests/support/peer_venv.py): imports nothing of Conveyor's.

argv: base_url (…/v1), api key, model. An Agent with one function tool, its model the SDK's default class
(OpenAIResponsesModel: the Responses API), made to call the tool on its first turn (tool_choice required; the SDK
resets it to auto once a tool ran, so the loop can end). Prints one JSON line: what the tool was called with, the
run's items, its final output and the ids of the responses the model calls made. Tracing is off: its export would
go to OpenAI's servers."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Literal

import agents
from openai import AsyncOpenAI


async def main(base_url: str, api_key: str, model_name: str) -> dict:
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_current_weather(city: Literal["Paris", "Rome"]) -> str:
        """The current weather in a city."""
        called.append(city)
        return "21 degrees and sunny"

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_current_weather],
        model=agents.OpenAIResponsesModel(model=model_name, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40),
    )
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    return {
        "called": called,
        "arguments": [i.raw_item.arguments for i in result.new_items if i.type == "tool_call_item"],
        "items": [i.type for i in result.new_items],
        "final_output": result.final_output,
        "response_ids": [r.response_id for r in result.raw_responses],
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
