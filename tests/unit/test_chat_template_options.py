"""How the tokenizer writes a request's messages (shared/text/chat_template.py, from RequestReceived's fields): with the
assistant turn's opening, without it, ending inside the last message (continue_final_message), and with the
template variables of chat_template_kwargs."""

from __future__ import annotations

import copy
import json

import pytest

from tests.support.factories import chat_received
from services.tokenizer.service import Preprocessor, PromptError
from shared.text.chat_template import kwargs_problem
from shared.text.tokenization import load_tokenizer

PREFILL = [("user", "Name a colour."), ("assistant", "My favourite colour is")]


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def _text(tok, messages, **fields) -> str:
    ev = chat_received(messages, max_tokens=4, **fields)
    return tok.decode(Preprocessor(tok, 8192).token_ids(ev))


def test_by_default_the_prompt_ends_with_the_assistant_turns_opening(tok):
    assert _text(tok, PREFILL[:1]).endswith("<|im_start|>assistant\n")


def test_without_add_generation_prompt_the_prompt_ends_with_the_last_turn_closed(tok):
    assert _text(tok, PREFILL[:1], add_generation_prompt=False).endswith("Name a colour.<|im_end|>\n")


def test_continue_final_message_ends_the_prompt_inside_the_last_message(tok):
    text = _text(tok, PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")


def test_chat_template_kwargs_are_variables_of_the_template(tok):
    own = copy.copy(tok)
    own.chat_template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}{% endfor %}"
    assert _text(own, PREFILL[:1], chat_template_kwargs=json.dumps({"greeting": "Ahoy"})) == "Ahoy Name a colour."


def test_a_template_that_cannot_use_a_variable_is_a_prompt_error_not_a_crash(tok):
    own = copy.copy(tok)
    own.chat_template = "{{ count + 1 }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(PromptError) as e:
        _text(own, PREFILL[:1], chat_template_kwargs=json.dumps({"count": "three"}))
    assert e.value.param == "messages"


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "messages", "add_generation_prompt", "raise_exception"])
def test_a_kwarg_that_is_the_template_calls_own_is_refused_by_name(key):
    assert kwargs_problem({key: True})[0] == key


def test_kwargs_beyond_their_size_limit_are_refused():
    assert kwargs_problem({"big": "x" * 70_000})[0] == ""
    assert kwargs_problem({"enable_thinking": False}) is None
