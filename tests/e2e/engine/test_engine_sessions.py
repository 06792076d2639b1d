"""Conversation sessions on the real model: each turn through a session (its KV kept between turns, or swapped to
the disk tier and back) answers exactly what transformers' greedy answers for the whole conversation so far; a
seeded sampled answer is the same whether or not it was preempted on the way."""

from __future__ import annotations

import pytest

from services.worker.engine import EngineRequest, SamplingOptions
from tests.support.engine import PASSAGE, run_to_completion

N = 12
GREEDY = SamplingOptions(temperature=0, max_tokens=N)
QUESTIONS = ["Tell me about the printing press.", "Who was Gutenberg?", "What changed for scholars?"]
SYSTEM = "You are a careful assistant. Background: " + PASSAGE


def squeeze(engine, rid: str) -> None:
    """A request that takes nearly the whole pool: every paused session must give its blocks back."""
    free_tokens = (engine.blocks.num_blocks - 2) * engine.blocks.block_size
    engine.add_request(EngineRequest(rid, list(range(1000, 1000 + free_tokens - 4)), SamplingOptions(max_tokens=2)))
    run_to_completion(engine)


@pytest.mark.parametrize("swap", [False, True], ids=["kept", "swapped"])
def test_every_turn_through_a_session_matches_greedy_on_the_whole_conversation(
    make_engine, chat, tokenizer, hf_reference, tmp_path, swap
):
    extra = {"num_kv_blocks": 64, "session_swap_dir": str(tmp_path / "tier")} if swap else {}
    engine = make_engine(**extra)
    history: list[dict] = []
    previous = 0  # the last turn's prompt length
    for k, question in enumerate(QUESTIONS):
        prompt = chat(question, system=SYSTEM, history=history)
        engine.add_request(EngineRequest(f"turn{k}", prompt, GREEDY, session_id="conversation"))
        runs, _ = run_to_completion(engine)
        run = runs[f"turn{k}"]
        assert run.tokens == hf_reference(prompt, N), k
        # the conversation so far came from the session's KV: only the new tokens were computed
        assert run.cached_tokens >= previous // 16 * 16, (k, run.cached_tokens, previous)
        previous = len(prompt)
        history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": tokenizer.decode(run.tokens, skip_special_tokens=True)},
        ]
        if swap:
            squeeze(engine, f"squeeze{k}")
            assert engine.stats().sessions["sessions_swapped"] == 1, k
    assert engine.sessions.swap_ins == (len(QUESTIONS) - 1 if swap else 0)
    engine.close_session("conversation")
    engine.check_no_leak()


def test_a_seeded_sampled_answer_is_the_same_whether_it_was_preempted_and_recomputed_or_swapped(
    make_engine, chat, tmp_path
):
    # Prompts that differ from their first words: a preempted one's blocks are its own, evicted while it waits.
    prompts = [chat(q + " " + PASSAGE) for q in ("Summarize this text.", "Name one effect of the press in")]
    sampled = SamplingOptions(temperature=0.9, top_p=0.95, seed=1234, max_tokens=100)  # the survivor evicts
    answers, preempted, swapped_in = [], [], []
    # 24 blocks hold one of them at a time: the other is preempted, then recomputed or (with a tier) swapped back
    for blocks, tier in ((256, None), (24, None), (24, str(tmp_path / "tier"))):
        engine = make_engine(num_kv_blocks=blocks, session_swap_dir=tier)
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", p, sampled))
        runs, _ = run_to_completion(engine)
        answers.append({rid: r.tokens for rid, r in runs.items()})
        preempted.append(engine.stats().num_preemptions)
        swapped_in.append(engine.sessions.swap_ins)
        engine.check_no_leak()
    assert preempted[0] == 0 and preempted[1] > 0 and preempted[2] > 0, preempted
    assert swapped_in == [0, 0, swapped_in[2]] and swapped_in[2] > 0, swapped_in
    assert answers[0] == answers[1] == answers[2]
