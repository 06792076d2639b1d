"""The start-up warm-up on the real model: it changes no answer (its prompts' blocks left in the prefix cache are
never a false hit) and leaves the pool as it found it."""

from __future__ import annotations

from tests.support.engine import QUESTIONS, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions
from services.worker.engine.warmup import warm_up

N = 16


def test_greedy_outputs_after_the_warm_up_match_hf_greedy(make_engine, chat, hf_reference):
    engine = make_engine(max_num_batched_tokens=128, max_num_seqs=8)  # small buckets: a quick warm-up
    report = warm_up(engine, budget_s=120)
    assert report.skipped == [] and report.decode_batches == [8, 4, 2, 1]
    prompts = {f"q{i}": chat(q) for i, q in enumerate(QUESTIONS[:4])}
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=N)))
    runs, _ = run_to_completion(engine)
    assert set(runs) == set(prompts)  # no warm-up request's output among them
    for rid, prompt in prompts.items():
        assert runs[rid].tokens == hf_reference(prompt, N)
    engine.check_no_leak()
