"""Grammar-constrained decoding in the engine (structured.py): valid output, resume by replay, preemption, and
that unconstrained rows batched with constrained ones are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tests.support.engine import Run, collect

from services.worker.engine import EngineRequest, InvalidRequestError, SamplingOptions
from services.worker.engine.request import GrammarSpec
from services.worker.engine.sampling.structured import StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMAR = GrammarSpec("json_schema", json.dumps(PERSON))
QUESTION = "Give me a person as JSON."


@pytest.fixture
def engine(make_engine, model_dir):
    def build(**overrides):
        eng = make_engine(**overrides)
        eng.structured = StructuredOutputs(model_dir / "tokenizer.json", eng.vocab_size, eng.eos_token_ids)
        return eng

    return build


def _run(eng, requests: list[EngineRequest]) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    for req in requests:
        eng.add_request(req)
        runs[req.request_id] = Run(tokens=list(req.output_token_ids))  # a resumed one's outputs come first
    while eng.has_unfinished():
        collect(eng.step(), runs)
    eng.check_no_leak()
    return runs


def _constrained(
    rid: str, prompt: list[int], temperature: float = 0.0, outputs: list[int] | None = None, max_tokens: int = 40
) -> EngineRequest:
    opts = SamplingOptions(temperature=temperature, seed=11, max_tokens=max_tokens, grammar=GRAMMAR)
    return EngineRequest(rid, prompt, opts, output_token_ids=list(outputs or []))


def test_constrained_outputs_validate_against_the_schema_greedy_and_sampled(engine, chat, tokenizer):
    prompt = chat(QUESTION)
    runs = _run(engine(), [_constrained(f"t{i}", prompt, temperature=t) for i, t in enumerate([0.0, 1.0, 1.0])])
    for run in runs.values():
        assert run.finish_reason == "stop" and run.tokens[-1] == tokenizer.eos_token_id
        jsonschema.validate(json.loads(tokenizer.decode(run.tokens[:-1])), PERSON)


def test_unconstrained_rows_batched_with_constrained_ones_are_unchanged(engine, chat, hf_reference):
    prompt = chat("Name a famous painter.")
    free = EngineRequest("free", prompt, SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True))
    runs = _run(engine(), [free, _constrained("c", chat(QUESTION))])
    assert runs["free"].tokens == hf_reference(prompt, 12)


def test_resumed_constrained_request_replays_its_outputs_and_continues_the_same(engine, chat):
    prompt = chat(QUESTION)
    whole = _run(engine(), [_constrained("a", prompt)])["a"].tokens
    cut = len(whole) // 2
    resumed = _run(engine(), [_constrained("b", prompt, outputs=whole[:cut])])["b"].tokens
    assert resumed == whole


def test_preempted_constrained_requests_give_the_same_outputs(engine, chat):
    prompts = [chat(f"{QUESTION} Number {i}.") for i in range(6)]
    roomy = _run(engine(), [_constrained(f"r{i}", p) for i, p in enumerate(prompts)])
    need = sum(-(-(len(p) + 20) // 16) for p in prompts)
    tight_engine = engine(num_kv_blocks=need // 2)  # about half of what all six need at once
    tight = _run(tight_engine, [_constrained(f"r{i}", p) for i, p in enumerate(prompts)])
    assert tight_engine.stats().num_preemptions > 0
    assert {k: r.tokens for k, r in tight.items()} == {k: r.tokens for k, r in roomy.items()}


def test_resumed_outputs_that_break_the_grammar_are_refused(engine, chat, tokenizer):
    bad = tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="does not fit"):
        engine().add_request(_constrained("x", chat(QUESTION), outputs=bad))


def test_a_schema_that_does_not_compile_is_refused_not_crashed(engine, chat):
    req = EngineRequest(
        "x",
        chat(QUESTION),
        SamplingOptions(max_tokens=4, grammar=GrammarSpec("json_schema", json.dumps({"type": "objectx"}))),
    )
    eng = engine()
    with pytest.raises(InvalidRequestError, match="constraint"):
        eng.add_request(req)
    assert not eng.has_unfinished()


def test_max_tokens_cuts_a_constrained_output_with_length(engine, chat):
    run = _run(engine(), [_constrained("c", chat(QUESTION), max_tokens=3)])["c"]
    assert run.finish_reason == "length" and len(run.tokens) == 3
