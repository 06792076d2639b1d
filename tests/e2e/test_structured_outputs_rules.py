"""vLLM's structured_outputs and TGI's grammar where the model's numbers do not matter, over HTTP against the
session's simulated cluster (its worker keeps to the grammar as the real one does): answers that stop match their
constraint, and every bad or conflicting constraint is a 400 naming its field."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.support.openai_fixtures import MODEL

ASK = [{"role": "user", "content": "Give me a code."}]
CODE = r"[A-Z]{2}-[0-9]{3}"


def _post(cluster, path: str, **body) -> httpx.Response:
    if path.startswith("/v1"):
        body = {"model": MODEL, **body}
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=60)


def _chat(cluster, **body) -> httpx.Response:
    return _post(cluster, "/v1/chat/completions", messages=ASK, max_tokens=20, **body)


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_regex_constrained_answer_that_stops_matches_it_whole(sim_cluster, path):
    prompt = {"prompt": "A code:"} if path == "/v1/completions" else {"messages": ASK}
    r = _post(sim_cluster, path, max_tokens=20, temperature=0, structured_outputs={"regex": CODE}, **prompt)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and re.fullmatch(CODE, text), choice


def test_a_choice_constrained_answer_is_one_of_the_choices(sim_cluster):
    r = _chat(sim_cluster, structured_outputs={"choice": ["red", "green", "blue"]}, n=3, seed=5)
    assert r.status_code == 200, r.text
    assert {c["finish_reason"] for c in r.json()["choices"]} == {"stop"}
    assert all(c["message"]["content"] in ("red", "green", "blue") for c in r.json()["choices"])


def test_a_tgi_grammar_on_generate_constrains_the_native_answer(sim_cluster):
    r = _post(sim_cluster, "/generate", prompt="A code:", max_tokens=20, grammar={"type": "regex", "value": CODE})
    assert r.status_code == 200, r.text
    assert r.json()["finish_reason"] == "stop" and re.fullmatch(CODE, r.json()["text"]), r.json()


@pytest.mark.parametrize(
    "so, param",
    [
        ({"regex": "[0-9"}, "structured_outputs.regex"),
        ({"grammar": "this is no grammar"}, "structured_outputs.grammar"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
        ({"backend": "xgrammar"}, "structured_outputs.backend"),
    ],
    ids=["regex", "grammar", "grammar_rule", "schema", "schema_text", "no_choice", "whitespace", "tag", "unknown"],
)
def test_a_bad_structured_output_is_a_400_naming_its_field(sim_cluster, so, param):
    assert _error(_chat(sim_cluster, structured_outputs=so))["param"] == param


def test_two_constraints_at_once_are_a_400_naming_both(sim_cluster):
    err = _error(_chat(sim_cluster, structured_outputs={"regex": "a+", "choice": ["a"]}))
    assert err["param"] == "structured_outputs" and "regex and choice" in err["message"], err


@pytest.mark.parametrize(
    "other",
    [
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        {"ignore_eos": True},
    ],
    ids=["response_format", "tools", "ignore_eos"],
)
def test_structured_outputs_with_another_constraint_is_a_400(sim_cluster, other):
    err = _error(_chat(sim_cluster, structured_outputs={"regex": "a+"}, **other))
    assert err["param"] in ("structured_outputs", "ignore_eos") and err["code"] == "unsupported_parameter", err


@pytest.mark.parametrize("old", ["guided_regex", "guided_json", "guided_choice", "guided_grammar"])
def test_vllms_removed_guided_fields_are_a_400_naming_the_replacement(sim_cluster, old):
    err = _error(_chat(sim_cluster, **{old: "x"}))
    new = "structured_outputs." + old.removeprefix("guided_")
    assert err["param"] == old and new in err["message"], err


@pytest.mark.parametrize(
    "grammar, param",
    [({"type": "regex", "value": "(a"}, "grammar.value"), ({"type": "lark", "value": "x"}, "grammar.type")],
    ids=["bad_regex", "unknown_type"],
)
def test_a_bad_tgi_grammar_is_a_400_naming_it(sim_cluster, grammar, param):
    assert _error(_post(sim_cluster, "/generate", prompt="Hi", max_tokens=2, grammar=grammar))["param"] == param
