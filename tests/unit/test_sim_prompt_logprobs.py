"""Prompt log probabilities in the simulated engine (the real scheduler and prefix cache, synthetic values), and on
the wire: a request that asks gets one entry per prompt token after the first, with its first token, the same
whether its prefix was cached, its prefill chunked or it was preempted; an event without them still decodes."""

from __future__ import annotations

import msgspec
import pytest

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import SimRunner
from shared.wire.events import TokenDelta, TokenGenerated
from shared.wire.logprobs import pack_prompt, unpack_prompt

TIMING = SimTiming(step_overhead_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0, decode_s_per_kv_token=0.0)
PROMPT = list(range(1000, 1100))  # six full 16-token blocks and a part


def _engine(vocab, **overrides) -> LLMEngine:
    cfg = EngineConfig(**({"num_kv_blocks": 256, "max_num_batched_tokens": 512, "max_num_seqs": 8} | overrides))
    runner = SimRunner(TIMING, vocab, cfg.num_kv_blocks, sleep=lambda s: None)
    return LLMEngine(runner, cfg, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], int | None]]) -> dict:
    """-> request id: (its prompt logprobs or None, its cached prompt tokens)."""
    for rid, (prompt, k) in requests.items():
        opts = SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
        engine.add_request(EngineRequest(rid, prompt, opts))
    got: dict = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.prompt_logprobs is not None:
                assert got.get(o.request_id, (None,))[0] is None, "prompt log probabilities twice"
                assert o.first_index == 0 and o.new_token_ids
            lps, cached = got.get(o.request_id, (None, 0))
            got[o.request_id] = (o.prompt_logprobs if o.prompt_logprobs is not None else lps, o.num_cached_tokens)
    engine.check_no_leak()
    return got


def _expected(vocab, prompt: list[int], k: int) -> list[tuple]:
    return [vocab.prompt_logprob(prompt[p - 1], p, prompt[p], k) for p in range(1, len(prompt))]


def _as_tuples(entries) -> list[tuple]:
    return [(e.logprob, e.top_ids, e.top_logprobs, e.rank) for e in entries]


def test_a_request_that_asks_gets_every_prompt_tokens_and_one_that_does_not_none(vocab):
    got = _run(_engine(vocab), {"asks": (PROMPT, 4), "plain": (PROMPT[:30], None)})
    assert _as_tuples(got["asks"][0]) == _expected(vocab, PROMPT, 4)
    assert got["plain"][0] is None


def test_a_cached_prefix_is_not_served_to_a_request_that_owes_prompt_logprobs(vocab):
    engine = _engine(vocab)
    _run(engine, {"warm": (PROMPT, None)})
    got = _run(engine, {"asks": (PROMPT, 2), "plain": (PROMPT, None)})
    assert got["plain"][1] == 96, "the other request is served from the cache"
    assert got["asks"][1] == 0
    assert _as_tuples(got["asks"][0]) == _expected(vocab, PROMPT, 2)


@pytest.mark.parametrize(
    "overrides",
    [{"max_num_batched_tokens": 24}, {"num_kv_blocks": 10, "max_num_batched_tokens": 48}],
    ids=["chunked", "tight"],
)
def test_chunked_or_preempted_prefills_give_each_entry_once(vocab, overrides):
    prompts = {f"r{i}": (PROMPT[i:], 3) for i in range(3)}  # with 10 blocks they cannot all hold their prompts
    engine = _engine(vocab, **overrides)
    got = _run(engine, prompts)
    assert (engine.stats().num_preemptions > 0) == ("num_kv_blocks" in overrides)
    for rid, (prompt, _) in prompts.items():
        assert _as_tuples(got[rid][0]) == _expected(vocab, prompt, 3)


def test_prompt_logprobs_beyond_twenty_are_refused():
    from services.worker.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingOptions(prompt_logprobs=21).validate()


def test_prompt_logprobs_round_trip_the_wire_and_an_event_without_them_decodes(vocab):
    from services.worker.engine.outputs import TokenLogprobs

    entries = [TokenLogprobs(*vocab.prompt_logprob(PROMPT[p - 1], p, PROMPT[p], 2)) for p in range(1, 5)]
    delta = TokenDelta("r", 0, (7,), None, pack_prompt(PROMPT[:5], entries, 2))
    ev = msgspec.msgpack.decode(
        msgspec.msgpack.encode(TokenGenerated(worker_id="w", step=1, items=(delta,))), type=TokenGenerated
    )
    back = unpack_prompt(ev.items[0].prompt)
    assert [e.rank for e in back] == [e.rank for e in entries] and ev.items[0].prompt.token_ids == tuple(PROMPT[:5])
    assert all(abs(a.logprob - b.logprob) < 1e-6 and a.top_ids == b.top_ids for a, b in zip(back, entries))
    old = msgspec.msgpack.encode(["r", 0, [7]])  # an older worker's delta: no logprobs, no prompt
    assert msgspec.msgpack.decode(old, type=TokenDelta).prompt is None
