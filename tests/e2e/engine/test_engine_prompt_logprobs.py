"""Prompt log probabilities (`prompt_logprobs`) against transformers' log_softmax of one full float32 forward.

Prompt token p's entry is the log-softmax of the logits at position p - 1 (raw: no penalty or temperature), its
rank among the whole vocabulary, and the k most likely there; checked with the prompt's prefix in the prefix
cache (which the request must not be served from) and across chunked prefill.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.engine import PASSAGE, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions

TOL = 1e-4


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PASSAGE)  # ~150 tokens: ten 16-token blocks


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row j scores prompt token j + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].double(), dim=-1)


def assert_matches(entries, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) - 1 == ref.shape[0]
    for j, lp in enumerate(entries):
        row, token = ref[j], prompt[j + 1]
        want = row[token].item()
        assert abs(lp.logprob - want) < TOL, (j, lp.logprob, want)
        # its rank: 1 + how many tokens are more likely (a near-tie within the tolerance may go either way)
        assert int((row > want + TOL).sum()) + 1 <= lp.rank <= int((row > want - TOL).sum()) + 1, (j, lp.rank)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        for tid, value in zip(lp.top_ids, lp.top_logprobs):
            assert abs(value - row[tid].item()) < TOL, (j, tid, value, row[tid].item())
        assert torch.allclose(torch.tensor(lp.top_logprobs, dtype=torch.float64), row.topk(k).values, atol=TOL, rtol=0)


def _add(engine, rid: str, prompt: list[int], prompt_logprobs: int | None = 5) -> None:
    opts = SamplingOptions(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    engine.add_request(EngineRequest(rid, prompt, opts))


def test_prompt_logprobs_equal_transformers_and_others_in_the_batch_get_none(make_engine, hf_model, prompt):
    engine = make_engine()
    _add(engine, "asks", prompt)
    _add(engine, "plain", prompt[:40], None)
    runs, _ = run_to_completion(engine)
    assert_matches(runs["asks"].prompt_logprobs, reference(hf_model, prompt), prompt, 5)
    assert runs["plain"].prompt_logprobs is None
    engine.check_no_leak()


def test_prompt_logprobs_are_the_full_forwards_with_the_prefix_in_the_prefix_cache(make_engine, hf_model, prompt):
    engine = make_engine()
    _add(engine, "warm", prompt, None)  # caches the prompt's full blocks
    run_to_completion(engine)
    longer = prompt + prompt[:20]
    _add(engine, "same", prompt)
    _add(engine, "longer", longer, 0)
    _add(engine, "plain", prompt, None)
    runs, _ = run_to_completion(engine)
    assert runs["plain"].cached_tokens > 0, "the prefix is cached"
    assert runs["same"].cached_tokens == runs["longer"].cached_tokens == 0, "served past what they need computed"
    assert_matches(runs["same"].prompt_logprobs, reference(hf_model, prompt), prompt, 5)
    assert_matches(runs["longer"].prompt_logprobs, reference(hf_model, longer), longer, 0)
    engine.check_no_leak()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_prompt_logprobs_across_chunked_prefill(make_engine, hf_model, prompt, fused):
    engine = make_engine(max_num_batched_tokens=24, fused_model=fused)  # seven chunks, mixed with the other's
    _add(engine, "chunked", prompt, 3)
    _add(engine, "beside", prompt[5:60], 2)
    runs, steps = run_to_completion(engine)
    assert sum(1 for s in steps if s.num_prefill_tokens) >= 6
    assert_matches(runs["chunked"].prompt_logprobs, reference(hf_model, prompt), prompt, 3)
    assert_matches(runs["beside"].prompt_logprobs, reference(hf_model, prompt[5:60]), prompt[5:60], 2)
    engine.check_no_leak()


def test_a_one_token_prompt_has_no_prompt_logprobs_to_give(make_engine, prompt):
    engine = make_engine()
    _add(engine, "one", prompt[:1])
    runs, _ = run_to_completion(engine)
    assert runs["one"].prompt_logprobs == [] and len(runs["one"].tokens) == 2
