"""The tokenizer puts a request's tools into its prompt (shared/text/chat_template.py): SmolLM2's template
has no tool support, so they go into a system turn with the call format the gateway reads back."""

from __future__ import annotations

import json

import pytest

from tests.support.factories import chat_received
from services.tokenizer.service import Preprocessor
from shared.text.chat_template import template_takes_tools
from shared.text.tokenization import load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def pre(model_dir):
    return Preprocessor(load_tokenizer(model_dir), 8192)


def _prompt(pre, messages: list[tuple[str, str]], tools: str = "") -> str:
    ev = chat_received(messages, max_tokens=4, tools=tools)
    return pre.tok.decode(pre.token_ids(ev))


def test_smollm2_template_has_no_tool_support_so_the_generic_prompt_is_used(pre):
    assert not template_takes_tools(pre.tok)


def test_tools_go_into_a_system_turn_with_the_call_format(pre):
    text = _prompt(pre, [("user", "Weather in Oslo?")], json.dumps(TOOLS))
    assert text.startswith("<|im_start|>system\nYou can call these functions")
    assert '"name": "get_weather"' in text and '[{"name": "<function name>", "arguments"' in text
    assert "You are a helpful AI assistant named SmolLM" not in text


def test_the_clients_system_turn_is_kept_and_the_tools_follow_it(pre):
    text = _prompt(pre, [("system", "Be brief."), ("user", "Weather in Oslo?")], json.dumps(TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")


def test_without_tools_the_prompt_is_the_templates_own(pre):
    plain = _prompt(pre, [("user", "Weather in Oslo?")])
    assert plain == pre.tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Oslo?"}], add_generation_prompt=True, tokenize=False
    )
