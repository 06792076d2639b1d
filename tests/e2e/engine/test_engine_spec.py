"""Speculative decoding with prompt-lookup drafts on the real model: greedy outputs are transformers' own, token
for token, with drafts accepted on text that repeats its prompt."""

from __future__ import annotations

from tests.support.engine import QUESTIONS, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions

N = 48
REPEAT = "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."


def test_greedy_outputs_with_drafts_match_hf_greedy_and_drafts_are_accepted(make_engine, chat, hf_reference):
    engine = make_engine(spec_ngram_tokens=4)
    prompts = {"repeat": chat(REPEAT)} | {f"q{i}": chat(q) for i, q in enumerate(QUESTIONS[:3])}
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=N)))
    runs, _ = run_to_completion(engine)
    for rid, prompt in prompts.items():
        assert runs[rid].tokens == hf_reference(prompt, N), rid
    stats = engine.stats()
    assert stats.num_draft_accepted > 0 and stats.num_drafted > stats.num_draft_accepted
    engine.check_no_leak()


def test_a_lone_greedy_stream_that_repeats_its_prompt_takes_fewer_steps_with_drafts(make_engine, chat, hf_reference):
    steps = {}
    for k in (0, 4):
        engine = make_engine(spec_ngram_tokens=k)
        engine.add_request(EngineRequest("r", chat(REPEAT), SamplingOptions(temperature=0, max_tokens=N)))
        runs, results = run_to_completion(engine)
        assert runs["r"].tokens == hf_reference(chat(REPEAT), N)
        steps[k] = len(results)
    assert steps[4] < steps[0]
