"""Prefix caching: shared prefixes and a chat's second turn reuse blocks, outputs unchanged."""

from __future__ import annotations

from tests.support.engine import PASSAGE, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions

N = 16
GREEDY = SamplingOptions(temperature=0, max_tokens=N)
SYSTEM = "You are a careful assistant. Use this background text when it helps: " + PASSAGE


def test_prompts_sharing_a_long_prefix_reuse_cached_blocks(make_engine, chat, hf_reference):
    engine = make_engine()
    questions = ["Who invented the printing press?", "How fast could the press print?", "Name one effect."]
    prompts = [chat(q, system=SYSTEM) for q in questions]
    engine.add_request(EngineRequest("first", prompts[0], GREEDY))
    runs, _ = run_to_completion(engine)  # first request fills the cache
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(EngineRequest(f"later{i}", p, GREEDY))
    run_to_completion(engine, runs)
    shared = min(len(p) for p in prompts) - 20  # the questions differ only in their last ~20 tokens
    for i, p in enumerate(prompts):
        rid = "first" if i == 0 else f"later{i}"
        assert runs[rid].tokens == hf_reference(p, N), rid
        if i:
            assert runs[rid].cached_tokens >= shared // 16 * 16 - 16 > 0, (rid, runs[rid].cached_tokens)
    assert runs["first"].cached_tokens == 0
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    engine.check_no_leak()


def test_outputs_identical_with_and_without_prefix_cache(make_engine, chat):
    prompts = [chat(q, system=SYSTEM) for q in ("Summarize the text.", "Summarize the text in French.")]
    results = []
    for caching in (False, True):
        engine = make_engine(enable_prefix_caching=caching)
        runs = {}
        for i, p in enumerate(prompts):  # one after the other, so the second can hit the cache
            engine.add_request(EngineRequest(f"r{i}", p, GREEDY))
            run_to_completion(engine, runs)
        results.append({rid: r.tokens for rid, r in runs.items()})
        assert (runs["r1"].cached_tokens > 0) == caching
        engine.check_no_leak()
    assert results[0] == results[1]


def test_second_chat_turn_reuses_first_turn_blocks(make_engine, chat, tokenizer, hf_reference):
    engine = make_engine()
    turn1 = chat("Tell me about the printing press.", system=SYSTEM)
    engine.add_request(EngineRequest("turn1", turn1, GREEDY))
    runs, _ = run_to_completion(engine)
    reply = tokenizer.decode(runs["turn1"].tokens, skip_special_tokens=True)
    history = [
        {"role": "user", "content": "Tell me about the printing press."},
        {"role": "assistant", "content": reply},
    ]
    turn2 = chat("And who was Gutenberg?", system=SYSTEM, history=history)
    assert turn2[: len(turn1)] == turn1, "the second turn's prompt extends the first's"
    engine.add_request(EngineRequest("turn2", turn2, GREEDY))
    run_to_completion(engine, runs)
    assert runs["turn2"].cached_tokens >= len(turn1) // 16 * 16
    assert runs["turn2"].tokens == hf_reference(turn2, N)
    engine.check_no_leak()
