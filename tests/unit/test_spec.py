"""Prompt-lookup drafts (engine/spec.py): what the n-gram index proposes, what the check keeps, and the engine's
scheduler never drafting where a draft could change a token or cost anyone else room."""

from __future__ import annotations

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.request import Sequence, SequenceStatus
from services.worker.engine.sampling.spec import NgramIndex, accept, draft


def test_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix_are_proposed():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert NgramIndex(2, 4).propose(tokens, 3) == [7, 8, 5]  # [1, 2, 3] last occurred before at 5-7


def test_the_longest_suffix_seen_before_wins_over_a_shorter_one():
    tokens = [4, 5, 6, 1, 6, 2, 4, 5, 6]
    # [5, 6] occurred at 1-2 (then 1); [6] alone later at 4 (then 2): min_n 1 would take the 2-gram's
    assert NgramIndex(1, 3).propose(tokens, 1) == [1]


def test_nothing_is_proposed_without_an_earlier_occurrence_of_min_n_tokens():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5, 6], 4) == []
    assert NgramIndex(2, 4).propose([1, 2], 4) == []


def test_the_index_follows_tokens_appended_after_a_proposal():
    idx, tokens = NgramIndex(2, 2), [1, 2, 3, 4]
    assert idx.propose(tokens, 2) == []
    tokens += [1, 2]
    assert idx.propose(tokens, 2) == [3, 4]


def test_a_proposal_is_cut_at_the_end_of_the_tokens():
    assert NgramIndex(2, 2).propose([7, 8, 7, 8], 5) == [7, 8]


def test_every_draft_the_model_agrees_with_is_kept_with_the_token_after_it():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]


def test_the_first_disagreement_ends_the_kept_run_with_the_models_own_token():
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept([5, 6], [4, 6, 0]) == [4]


def seq(sampling: SamplingOptions, tokens: list[int], outputs: int = 1) -> Sequence:
    s = Sequence(EngineRequest("r", tokens[:-outputs], sampling, output_token_ids=tokens[-outputs:]), 0, frozenset())
    s.status = SequenceStatus.DECODING
    return s


CFG = EngineConfig(spec_ngram_tokens=4)
REPEATING = [1, 2, 3, 4, 5, 6, 1, 2, 3]


def test_a_greedy_decoding_sequence_gets_drafts_within_max_tokens_and_the_context_window():
    s = seq(SamplingOptions(temperature=0, max_tokens=100), REPEATING)
    assert draft(s, CFG, room=100, max_len=1000) == [4, 5, 6, 1]
    assert draft(s, CFG, room=2, max_len=1000) == [4, 5]
    assert draft(s, CFG, room=100, max_len=len(REPEATING) + 2) == [4]  # room for the draft and the token after
    assert draft(seq(SamplingOptions(temperature=0, max_tokens=3), REPEATING), CFG, 100, 1000) == [4]


def test_no_draft_where_the_next_token_is_not_a_plain_argmax_of_its_row():
    for opts in (
        SamplingOptions(temperature=0.7, max_tokens=100),
        SamplingOptions(temperature=0, max_tokens=100, logprobs=2),
        SamplingOptions(temperature=0, max_tokens=100, repetition_penalty=1.2),
        SamplingOptions(temperature=0, max_tokens=100, presence_penalty=0.5),
        SamplingOptions(temperature=0, max_tokens=100, logit_bias=((3, 5.0),)),
        SamplingOptions(temperature=0, max_tokens=100, min_tokens=10),
    ):
        assert draft(seq(opts, REPEATING), CFG, room=100, max_len=1000) == [], opts


def test_the_simulated_runner_gets_no_drafts_it_cannot_check(vocab):
    from services.worker.engine.sim.sim_model import SimTiming
    from services.worker.engine.sim.sim_runner import SimRunner

    runner = SimRunner(SimTiming(0, 0, 0, 0), vocab, 64, 0.0, sleep=lambda s: None)
    engine = LLMEngine(runner, CFG, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)
    assert engine.scheduler.spec_tokens == 0
