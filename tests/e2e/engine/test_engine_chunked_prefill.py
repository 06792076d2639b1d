"""Chunked prefill: a prompt longer than the step budget is prefilled across steps while
the other requests keep decoding, and every output is unchanged."""

from __future__ import annotations

from tests.support.engine import PASSAGE, collect

from services.worker.engine import EngineRequest, SamplingOptions

N = 16


def test_long_prompt_is_chunked_while_others_keep_decoding(make_engine, chat, hf_reference):
    engine = make_engine(max_num_batched_tokens=64)
    long_prompt = chat("Read this and list its three main claims:\n" + PASSAGE + PASSAGE)
    assert len(long_prompt) > 300
    short = {f"s{i}": chat(q) for i, q in enumerate(["Name a color.", "Write a haiku about the sea."])}
    for rid, p in short.items():
        engine.add_request(EngineRequest(rid, p, SamplingOptions(temperature=0, max_tokens=N + 8)))
    runs = {}
    while not all(rid in runs for rid in short):  # both short ones are decoding
        collect(engine.step(), runs)
    engine.add_request(EngineRequest("long", long_prompt, SamplingOptions(temperature=0, max_tokens=N)))
    prefill_steps = 0
    while engine.has_unfinished():
        result = engine.step()
        long_prefilling = result.num_prefill_tokens > 0 and "long" not in {o.request_id for o in result.outputs}
        if long_prefilling:
            prefill_steps += 1
            assert result.num_prefill_tokens + result.num_decode_tokens <= 64
            decoding = {o.request_id for o in result.outputs if o.new_token_ids}
            unfinished_short = {rid for rid in short if not runs[rid].finished}
            assert unfinished_short <= decoding, "the short requests got a token in this prefill step"
        collect(result, runs)
    # budget 64 minus two decodes per step; the step computing the last chunk also samples
    assert prefill_steps >= (len(long_prompt) - 16) // 62 - 1 >= 3, f"prefilled in {prefill_steps} steps"
    assert runs["long"].tokens == hf_reference(long_prompt, N)
    for rid, p in short.items():
        assert runs[rid].tokens == hf_reference(p, N + 8), rid
    engine.check_no_leak()


def test_a_step_with_a_new_prompt_and_another_prompts_next_chunk_gives_both_their_greedy_tokens(
    make_engine, chat, hf_reference
):
    """The chunks of one step attend apart by kind: those starting at position 0 within themselves, those with
    cached context over the pool; the rows of both kinds must land back on their own requests."""
    budget = 128
    # No prefix cache: b's first chunk must start at position 0 (the chat template's first block would be shared).
    engine = make_engine(max_num_batched_tokens=budget, enable_prefix_caching=False)
    prompts = {"a": chat("Summarize in one line:\n" + PASSAGE), "b": chat("Give this a title:\n" + PASSAGE)}
    assert all(budget < len(p) < 2 * budget - 8 for p in prompts.values())
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, SamplingOptions(temperature=0, max_tokens=N)))
    runs = {}
    first = engine.step()  # a's first chunk, the whole budget
    assert first.num_prefill_tokens == budget and not any(o.new_token_ids for o in first.outputs)
    second = engine.step()  # a's last chunk (cached context) and b's first (none), together
    assert second.num_prefill_tokens == budget
    assert [o.request_id for o in second.outputs if o.new_token_ids] == ["a"]
    collect(second, runs)
    while engine.has_unfinished():
        collect(engine.step(), runs)
    for rid, p in prompts.items():
        assert runs[rid].tokens == hf_reference(p, N), rid
    engine.check_no_leak()
