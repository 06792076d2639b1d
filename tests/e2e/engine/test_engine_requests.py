"""Request lifecycle: resume, abort, requests that never fit, failure isolation."""

from __future__ import annotations

import pytest
import torch
from tests.support.engine import PASSAGE, QUESTIONS, Run, collect, run_to_completion

from services.worker.engine import EngineRequest, InvalidRequestError, SamplingOptions

N = 20


def greedy(n=N, **kw):
    return SamplingOptions(temperature=0, max_tokens=n, **kw)


def test_resume_with_output_token_ids_equals_uninterrupted_run(make_engine, chat, hf_reference):
    prompt = chat(QUESTIONS[8])
    expected = hf_reference(prompt, N)
    assert len(expected) == N
    engine = make_engine()
    engine.add_request(EngineRequest("resumed", prompt, greedy(), output_token_ids=expected[:8]))
    runs = {"resumed": Run(tokens=expected[:8])}  # collect() checks new indices continue at 8
    run_to_completion(engine, runs)
    assert runs["resumed"].tokens == expected and runs["resumed"].finish_reason == "length"
    engine.check_no_leak()


def test_abort_mid_decode_frees_blocks_and_stops_output(make_engine, chat, hf_reference):
    engine = make_engine()
    prompts = {"keep": chat(QUESTIONS[1]), "drop": chat(QUESTIONS[3])}
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, greedy(ignore_eos=True)))
    runs = {}
    for _ in range(4):
        collect(engine.step(), runs)
    held = engine.request_kv_info("drop")[0]
    free_before = engine.stats().free_blocks
    assert engine.abort_request("drop") and held > 0
    assert engine.stats().free_blocks == free_before + held
    assert not engine.abort_request("drop"), "unknown now"
    aborted_tokens = len(runs["drop"].tokens)
    run_to_completion(engine, runs)
    assert len(runs["drop"].tokens) == aborted_tokens and not runs["drop"].finished
    assert runs["keep"].tokens[: len(hf_reference(prompts["keep"], N))] == hf_reference(prompts["keep"], N)
    engine.check_no_leak()


def test_request_that_can_never_fit_fails_alone_with_too_long(make_engine, chat, hf_reference):
    engine = make_engine(num_kv_blocks=12)  # 192 tokens
    huge = chat(PASSAGE + PASSAGE)
    assert len(huge) > 192
    engine.add_request(EngineRequest("huge", huge, greedy()))
    engine.add_request(EngineRequest("small", chat(QUESTIONS[0]), greedy()))
    runs, _ = run_to_completion(engine)
    assert runs["huge"].finished and runs["huge"].error_reason == "too_long" and runs["huge"].tokens == []
    assert runs["small"].tokens == hf_reference(chat(QUESTIONS[0]), N) and runs["small"].error_reason is None
    engine.check_no_leak()


def add_greedy(engine, chat, n: int) -> dict[str, list[int]]:
    """Add the first n QUESTIONS as greedy requests r0..r{n-1}; returns their prompts."""
    prompts = {f"r{i}": chat(q) for i, q in enumerate(QUESTIONS[:n])}
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, greedy()))
    return prompts


def test_invalid_requests_are_refused_at_add(make_engine, chat):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request(EngineRequest("bad", chat("hi"), SamplingOptions(temperature=-1)))
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.add_request(EngineRequest("empty", [], greedy()))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.add_request(EngineRequest("vocab", [10**9], greedy()))
    assert not engine.has_unfinished()
    engine.check_no_leak()


def test_exception_for_one_request_fails_only_that_request(make_engine, chat, hf_reference, monkeypatch):
    engine = make_engine()
    prompts = add_greedy(engine, chat, 3)
    real_prepare = engine.runner.prepare

    def flaky_prepare(items):
        if any(seq.request_id == "r1" and seq.num_outputs >= 2 for seq, _ in items):
            raise ValueError("poisoned request")
        return real_prepare(items)

    monkeypatch.setattr(engine.runner, "prepare", flaky_prepare)
    runs, _ = run_to_completion(engine)
    assert runs["r1"].error_reason == "worker_error" and len(runs["r1"].tokens) == 2
    for rid in ("r0", "r2"):
        assert runs[rid].tokens == hf_reference(prompts[rid], N) and runs[rid].error_reason is None
    engine.check_no_leak()


def test_out_of_memory_shrinks_the_batch_instead_of_failing(make_engine, chat, hf_reference, monkeypatch):
    engine = make_engine()
    prompts = add_greedy(engine, chat, 4)
    real_prepare, real_forward = engine.runner.prepare, engine.runner.forward
    seen = {"seqs": 0, "ooms": 0}

    def prepare(items):
        seen["seqs"] = len(items)
        return real_prepare(items)

    def small_device_forward(step):
        if seen["seqs"] > 2:  # the device only fits two sequences per step
            seen["ooms"] += 1
            raise torch.OutOfMemoryError("simulated")
        return real_forward(step)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    monkeypatch.setattr(engine.runner, "forward", small_device_forward)
    runs, _ = run_to_completion(engine)
    for rid, p in prompts.items():
        assert runs[rid].error_reason is None and runs[rid].tokens == hf_reference(p, N), rid
    assert seen["ooms"] > 0
    engine.check_no_leak()


def test_abort_while_prefilling_or_waiting_leaves_no_leak(make_engine, chat):
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=1)
    engine.add_request(EngineRequest("prefilling", chat(PASSAGE), greedy()))
    engine.add_request(EngineRequest("waiting", chat(QUESTIONS[0]), greedy()))
    result = engine.step()
    assert result.transitions == [("prefilling", "PREFILLING")] and engine.stats().num_waiting == 1
    assert engine.request_kv_info("prefilling")[0] == 2
    assert engine.abort_request("waiting") and engine.abort_request("prefilling")
    assert not engine.has_unfinished()
    engine.check_no_leak()


def test_kv_info_of_a_request_is_readable_in_the_step_it_finishes(make_engine, chat):
    engine = make_engine()
    engine.add_request(EngineRequest("r", chat(QUESTIONS[0]), greedy(n=1)))
    result = engine.step()
    assert [(o.finished, o.finish_reason) for o in result.outputs] == [(True, "length")]
    assert result.transitions == [("r", "PREFILLING"), ("r", "DECODING")]
    blocks, cached = engine.request_kv_info("r")
    assert blocks > 0 and cached == 0
    engine.step()
    assert engine.request_kv_info("r") is None
    engine.check_no_leak()


def test_on_scheduled_gets_scheduling_decisions_before_the_forward_pass(make_engine, chat, monkeypatch):
    engine = make_engine()
    engine.add_request(EngineRequest("r", chat(QUESTIONS[0]), greedy(n=2)))
    seen, forwards = [], []
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda step: forwards.append(len(seen)) or real_forward(step))
    result = engine.step(on_scheduled=seen.extend)
    assert seen == [("r", "PREFILLING")] and forwards == [1], "reported before the forward pass ran"
    assert result.transitions == [("r", "DECODING")], "only what the forward pass caused is left"
    runs = {}
    collect(result, runs)
    run_to_completion(engine, runs)
    assert len(runs["r"].tokens) == 2
    engine.check_no_leak()
