"""The choices of one n > 1 request (a group: one prompt, n sequences) on one engine: the prompt is computed once.

Siblings waiting behind the sibling that computes the prompt are held until its blocks are in the prefix cache, then
admitted with those blocks as hits; each computes only the block holding the prompt's last token (its logits are
needed to sample). Each choice's tokens are exactly what it gets alone with the same seed.
"""

from __future__ import annotations

from tests.support.engine import PASSAGE, collect, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions

N = 4
MAX_TOKENS = 6


def _choices(prompt: list[int], group: str) -> list[EngineRequest]:
    return [
        EngineRequest(
            f"c{i}", prompt, SamplingOptions(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS), group_id=group
        )
        for i in range(N)
    ]


def _prefill_tokens(steps) -> int:
    return sum(s.num_prefill_tokens for s in steps)


def _tail(prompt_len: int, block_size: int) -> int:
    """Tokens a sibling computes itself: all but the full blocks before the one holding the last token."""
    return prompt_len - (prompt_len - 1) // block_size * block_size


def test_the_choices_of_one_request_compute_their_prompt_once_plus_each_tail(make_engine, chat):
    prompt = chat("Summarize the text.", system=PASSAGE)
    engine = make_engine()
    for req in _choices(prompt, "g"):
        engine.add_request(req)
    runs, steps = run_to_completion(engine)
    bs = engine.blocks.block_size
    assert _prefill_tokens(steps) == len(prompt) + (N - 1) * _tail(len(prompt), bs)
    shared = (len(prompt) - 1) // bs * bs
    assert sorted(r.cached_tokens for r in runs.values()) == [0] + [shared] * (N - 1)
    assert all(len(r.tokens) == MAX_TOKENS for r in runs.values())
    engine.check_no_leak()


def test_requests_without_a_group_arriving_together_each_compute_the_prompt(make_engine, chat):
    prompt = chat("Summarize the text.", system=PASSAGE)
    engine = make_engine()
    for req in _choices(prompt, ""):
        engine.add_request(req)
    _runs, steps = run_to_completion(engine)
    assert _prefill_tokens(steps) == N * len(prompt)  # what the hold saves: the control for the test above


def test_each_choice_gets_the_tokens_its_seed_gives_it_alone(make_engine, chat):
    prompt = chat("Write a haiku about the sea.")
    engine = make_engine()
    for req in _choices(prompt, "g"):
        engine.add_request(req)
    together, _ = run_to_completion(engine)
    for req in _choices(prompt, ""):
        alone = make_engine()
        alone.add_request(req)
        runs, _ = run_to_completion(alone)
        assert runs[req.request_id].tokens == together[req.request_id].tokens, req.request_id
    assert len({tuple(r.tokens) for r in together.values()}) > 1  # different seeds: different choices


def test_a_held_choice_does_not_hold_up_requests_behind_it(make_engine, chat):
    prompt = chat("Summarize the text.", system=PASSAGE)
    engine = make_engine()
    for req in _choices(prompt, "g"):
        engine.add_request(req)
    engine.add_request(EngineRequest("other", chat("Hi!"), SamplingOptions(temperature=0, max_tokens=MAX_TOKENS)))
    first, runs = engine.step(), {}
    collect(first, runs)
    admitted = {rid for rid, status in first.transitions if status == "PREFILLING"}
    assert admitted == {"c0", "other"}
    run_to_completion(engine, runs)
    engine.check_no_leak()
