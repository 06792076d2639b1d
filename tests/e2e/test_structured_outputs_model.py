"""vLLM's structured_outputs (regex, choice, grammar, json) through the official `openai` client against the real
model: every answer that ends with finish_reason "stop" is a whole match of its constraint, chat and completions,
streamed and whole, greedy and sampled."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.support.openai_fixtures import MODEL

DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
COLOURS = ["red", "green", "blue", "dark purple"]
# GBNF (llama.cpp / xgrammar) and Lark (llguidance): a greeting of one or more words, then a full stop
GBNF = 'root ::= "Hello" (" " [a-z]+)+ "."'
LARK = 'start: "Hello" (" " WORD)+ "."\nWORD: /[a-z]+/'
GREETING = r"Hello( [a-z]+)+\."
SAMPLINGS = {"greedy": {"temperature": 0}, "sampled": {"temperature": 1.0, "seed": 7}}
CASES = {
    "regex": ({"regex": DATE}, lambda t: re.fullmatch(DATE, t)),
    "choice": ({"choice": COLOURS}, lambda t: t in COLOURS),
    "gbnf": ({"grammar": GBNF}, lambda t: re.fullmatch(GREETING, t)),
    "lark": ({"grammar": LARK}, lambda t: re.fullmatch(GREETING, t)),
}
ASK = [{"role": "user", "content": "Answer in the requested format: what is today's date or your favourite colour?"}]


def _chat(client, stream: bool, **kw) -> tuple[str, str]:
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=ASK, **kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kw) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def _completion(client, stream: bool, **kw) -> tuple[str, str]:
    prompt = "Q: Name a date or a colour.\nA:"
    if not stream:
        out = client.completions.create(model=MODEL, prompt=prompt, **kw)
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw) if c.choices]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=list(SAMPLINGS))
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_structured_chat_answer_matches_its_constraint(client, case, sampling, stream):
    so, matches = CASES[case]
    text, finish = _chat(client, stream, max_tokens=40, extra_body={"structured_outputs": so}, **SAMPLINGS[sampling])
    assert finish == "stop" and matches(text), (text, finish)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_structured_completion_matches_its_constraint(client, case, stream):
    so, matches = CASES[case]
    text, finish = _completion(client, stream, max_tokens=40, temperature=0, extra_body={"structured_outputs": so})
    assert finish == "stop" and matches(text), (text, finish)


def test_a_structured_json_completion_is_valid_against_its_schema(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": COLOURS}, "shade": {"type": "integer"}},
        "required": ["colour", "shade"],
        "additionalProperties": False,
    }
    text, finish = _completion(
        client, False, max_tokens=40, temperature=0, extra_body={"structured_outputs": {"json": schema}}
    )
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
