"""Chunked prefill: a prompt longer than the step budget is prefilled across steps while
the other requests keep decoding, and every output is unchanged."""

from __future__ import annotations

from engine_helpers import PASSAGE, collect

from services.worker.engine import EngineRequest, SamplingOptions

N = 16


def test_long_prompt_is_chunked_while_others_keep_decoding(make_engine, chat, hf_greedy):
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
    assert runs["long"].tokens == hf_greedy(long_prompt, N)
    for rid, p in short.items():
        assert runs[rid].tokens == hf_greedy(p, N + 8), rid
    engine.check_no_leak()
