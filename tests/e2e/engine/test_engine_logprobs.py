"""Log probabilities and OpenAI's presence/frequency penalties, against transformers in float32.

The reference recomputes each position's next-token logits with transformers' own model (the session's float32
`hf_model`, the whole prompt + output at once), applies the penalties by their definitions, and takes the
log-softmax the sampler documents: after the penalties, divided by the temperature (greedy: as they are),
before top-k/top-p/min-p.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tests.support.engine import QUESTIONS, run_to_completion

from services.worker.engine import EngineRequest, InvalidRequestError, SamplingOptions

TOL = 1e-3


def reference_logprobs(model, prompt: list[int], outputs: list[int], opts: SamplingOptions) -> torch.Tensor:
    """[len(outputs), V]: the log-probabilities each output token was sampled from, by the definitions."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + outputs])).logits[0, len(prompt) - 1 : -1].double()
    rows = []
    for j, row in enumerate(logits):
        row = row.clone()
        if opts.repetition_penalty != 1.0:  # transformers' definition, over prompt and output so far
            seen = torch.tensor(sorted(set(prompt + outputs[:j])))
            s = row[seen]
            row[seen] = torch.where(s < 0, s * opts.repetition_penalty, s / opts.repetition_penalty)
        for token, count in Counter(outputs[:j]).items():  # OpenAI's, over the output so far
            row[token] -= count * opts.frequency_penalty + opts.presence_penalty
        rows.append(torch.log_softmax(row / (opts.temperature or 1.0), dim=-1))
    return torch.stack(rows)


def assert_matches_reference(run, ref: torch.Tensor, k: int) -> None:
    assert len(run.logprobs) == len(run.tokens) == ref.shape[0]
    for j, (token, lp) in enumerate(zip(run.tokens, run.logprobs)):
        assert abs(lp.logprob - ref[j, token].item()) < TOL, (j, lp.logprob, ref[j, token].item())
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        for tid, value in zip(lp.top_ids, lp.top_logprobs):  # each alternative's value is its own
            assert abs(value - ref[j, tid].item()) < TOL, (j, tid, value, ref[j, tid].item())
        if k:  # and they are the k most likely (a near-tie may swap which one comes k-th)
            ref_top = ref[j].topk(k).values
            assert torch.allclose(torch.tensor(lp.top_logprobs, dtype=torch.float64), ref_top, atol=TOL, rtol=0)


def test_logprobs_equal_transformers_log_softmax_greedy_and_sampled_in_one_batch(make_engine, chat, hf_model):
    prompts = {rid: chat(q) for rid, q in zip(("greedy", "sampled", "penalised", "plain"), QUESTIONS)}
    opts = {
        "greedy": SamplingOptions(temperature=0, max_tokens=12, logprobs=5),
        "sampled": SamplingOptions(
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            seed=7,
            max_tokens=12,
            logprobs=20,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            ignore_eos=True,
        ),
        "penalised": SamplingOptions(
            temperature=0, max_tokens=12, logprobs=0, frequency_penalty=1.0, repetition_penalty=1.2, ignore_eos=True
        ),
        "plain": SamplingOptions(temperature=0, max_tokens=12),
    }
    engine = make_engine()
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, opts[rid]))
    runs, _ = run_to_completion(engine)
    for rid in ("greedy", "sampled", "penalised"):
        ref = reference_logprobs(hf_model, prompts[rid], runs[rid].tokens, opts[rid])
        assert_matches_reference(runs[rid], ref, opts[rid].logprobs)
    assert runs["plain"].logprobs == [], "a request that did not ask gets none"
    greedy = runs["greedy"]
    assert all(lp.top_ids[0] == t and lp.top_logprobs[0] == lp.logprob for t, lp in zip(greedy.tokens, greedy.logprobs))
    engine.check_no_leak()


def test_without_logprobs_the_sampler_computes_nothing_extra(monkeypatch, make_engine, chat):
    from services.worker.engine.sampling import sampler

    def refuse(*_a, **_k):
        raise AssertionError("log probabilities computed though no request asked")

    monkeypatch.setattr(sampler, "_logprobs", refuse)
    logits = torch.randn(3, 50)

    class Seq:
        def __init__(self, temperature):
            self.sampling = SamplingOptions(temperature=temperature)
            self.token_ids, self.num_prompt_tokens, self.stop_ids = [1, 2], 2, frozenset()
            self.generator = torch.Generator().manual_seed(0)

        num_outputs = 0

    tokens, logprobs = sampler.sample(logits, [Seq(0.0), Seq(1.0), Seq(0.5)])
    assert logprobs is None and len(tokens) == 3 and tokens[0] == int(logits[0].argmax())


def _greedy(engine, prompt: list[int], **penalties) -> list[int]:
    rid = f"r{len(engine._seqs)}-{sorted(penalties.items())}"
    engine.add_request(
        EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=16, ignore_eos=True, **penalties))
    )
    runs, _ = run_to_completion(engine)
    return runs[rid].tokens


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    ],
    ids=["frequency", "presence", "negative-presence", "both"],
)
def test_penalised_greedy_output_is_the_argmax_of_the_penalised_logits(
    make_engine, tokenizer, chat, hf_model, penalties
):
    """Every greedy token is the argmax of transformers' logits penalised by OpenAI's definition over the
    output so far; and each penalty moves the output the way its sign says."""
    engine = make_engine()
    for prompt in (tokenizer.encode("one one one one one one one"), chat("Repeat the word 'hello' ten times.")):
        plain = _greedy(engine, prompt)
        got = _greedy(engine, prompt, **penalties)
        ref = reference_logprobs(hf_model, prompt, got, SamplingOptions(temperature=0, **penalties))
        assert got == ref.argmax(dim=-1).tolist(), (tokenizer.decode(got), tokenizer.decode(plain))
        most = max(Counter(plain).values())
        if all(v > 0 for v in penalties.values()):
            assert max(Counter(got).values()) <= most and len(set(got)) >= len(set(plain))
        else:
            assert len(set(got)) <= len(set(plain))
    engine.check_no_leak()


def test_a_strong_frequency_penalty_stops_a_repetition_the_model_would_make(make_engine, tokenizer):
    prompt = tokenizer.encode("one one one one one one one")
    engine = make_engine()
    plain = _greedy(engine, prompt)
    penalised = _greedy(engine, prompt, frequency_penalty=2.0)
    assert max(Counter(plain).values()) >= 4, tokenizer.decode(plain)  # "-to-many-to-many-to-many-..."
    assert max(Counter(penalised).values()) <= 2, tokenizer.decode(penalised)
    assert penalised != plain


def test_logprobs_of_a_preempted_request_are_those_of_an_uninterrupted_run(make_engine, chat):
    """A request preempted and recomputed gets each token's log probabilities once, the same values."""
    prompts = {f"p{i}": chat(q) for i, q in enumerate(QUESTIONS[:6])}
    opts = SamplingOptions(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    runs = {}
    for blocks in (256, sum(-(-(len(p) + 20) // 16) for p in prompts.values()) // 2):
        engine = make_engine(num_kv_blocks=blocks)
        for rid, p in prompts.items():
            engine.add_request(EngineRequest(rid, p, opts))
        runs[blocks], _ = run_to_completion(engine)
        assert (engine.stats().num_preemptions > 0) == (blocks != 256)
    big, small = runs.values()
    for rid in prompts:
        assert big[rid].tokens == small[rid].tokens and len(small[rid].logprobs) == 20
        for a, b in zip(big[rid].logprobs, small[rid].logprobs):
            assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": float("nan")},
        {"logprobs": 21},
        {"logprobs": -1},
    ],
)
def test_out_of_range_penalties_and_logprobs_are_refused(bad):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        SamplingOptions(**bad).validate()
