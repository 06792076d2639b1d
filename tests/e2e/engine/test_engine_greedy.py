"""Greedy outputs of a mixed batch equal transformers' generate, token for token."""

from __future__ import annotations

from tests.support.engine import QUESTIONS, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions

N = 24


def test_sixteen_chat_prompts_in_one_batch_match_hf_greedy(make_engine, chat, hf_reference, tokenizer):
    engine = make_engine()
    prompts = {f"q{i}": chat(q) for i, q in enumerate(QUESTIONS)}
    assert len(prompts) == 16 and len({len(p) for p in prompts.values()}) > 8, "mixed lengths"
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=N)))
    runs, steps = run_to_completion(engine)
    assert max(r.num_seqs for r in steps) == 16, "all sixteen ran in the same steps"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for rid, prompt in prompts.items():
        expected = hf_reference(prompt, N)
        assert runs[rid].tokens == expected, f"{rid}: {tokenizer.decode(runs[rid].tokens)!r}"
        assert runs[rid].finish_reason == ("stop" if expected[-1] == eos else "length")
    engine.check_no_leak()
