"""The simulated engine in process: the real LLMEngine (scheduler, paged blocks, prefix cache) with the
simulated runner. Its sleeps are recorded instead of slept, so each step's modelled time is read exactly."""

from __future__ import annotations

import json

import pytest

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.sim.sim_model import SimTiming, kv_pool_blocks
from services.worker.engine.sim.sim_runner import STEP_LOG_COLUMNS, SimRunner, open_step_log

TIMING = SimTiming(
    step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002, decode_s_per_kv_token=0.0001
)
GREEDY = SamplingOptions(temperature=0.0, max_tokens=8)


@pytest.fixture
def make_engine(vocab):
    def build(timing=TIMING, eos_probability=0.0, **overrides):
        cfg = EngineConfig(**({"num_kv_blocks": 256, "max_num_batched_tokens": 512, "max_num_seqs": 64} | overrides))
        sleeps: list[float] = []
        runner = SimRunner(timing, vocab, cfg.num_kv_blocks, eos_probability, sleep=sleeps.append)
        engine = LLMEngine(runner, cfg, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)
        return engine, sleeps

    return build


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
    """Step until done -> request id: (output tokens, finish reason)."""
    out: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            tokens, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason or o.error_reason)
    engine.check_no_leak()
    return out


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_modelled_step_time_is_overhead_plus_prefill_and_decode_costs_over_the_speedup():
    assert TIMING.step_time(0, 0, 0) == pytest.approx(0.01)
    assert TIMING.step_time(100, 0, 0) == pytest.approx(0.01 + 0.1)
    assert TIMING.step_time(0, 4, 200) == pytest.approx(0.01 + 0.008 + 0.02)
    fast = SimTiming(0.01, 0.001, 0.002, 0.0001, speedup=10)
    assert fast.step_time(100, 4, 200) == pytest.approx(TIMING.step_time(100, 4, 200) / 10)


def test_the_step_log_has_one_line_per_step_with_its_modelled_time_and_shape(vocab, tmp_path):
    cfg = EngineConfig(num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=64)
    log = open_step_log(str(tmp_path))
    engine = LLMEngine(
        SimRunner(TIMING, vocab, 256, sleep=lambda s: None, step_log=log),
        cfg,
        vocab.eos_token_ids,
        vocab.vocab_size,
        vocab.context_len,
    )
    engine.add_request(EngineRequest("r", prompt(31), SamplingOptions(temperature=0.0, max_tokens=2)))
    run(engine)
    log.close()
    lines = [
        dict(zip(STEP_LOG_COLUMNS, map(float, line.split())))
        for line in next(tmp_path.iterdir()).read_text().splitlines()
    ]
    assert [(x["prefill_tokens"], x["decode_seqs"], x["kv_tokens"], x["sampled"]) for x in lines] == [
        (31, 0, 0, 1),
        (0, 1, 32, 1),
    ]
    assert [x["modelled_s"] for x in lines] == pytest.approx(
        [TIMING.step_time(31, 0, 0), TIMING.step_time(0, 1, 32)], abs=1e-6
    )


def test_a_steps_modelled_time_grows_with_its_uncached_prompt_tokens(make_engine):
    times = []
    for n in (16, 64, 256):
        engine, sleeps = make_engine()
        engine.add_request(EngineRequest("r", prompt(n), GREEDY))
        engine.step()
        times.append(sleeps[0])
    assert times == pytest.approx([0.01 + 0.001 * n for n in (16, 64, 256)])


def test_a_decode_steps_modelled_time_grows_with_the_batch(make_engine):
    times = []
    for batch in (1, 4, 16):
        engine, sleeps = make_engine()
        for i in range(batch):
            engine.add_request(EngineRequest(f"r{i}", prompt(31, 1000 + 100 * i), GREEDY))
        engine.step()  # every prompt prefilled in one step; each has its first token
        engine.step()  # a pure decode step: 32 KV tokens per sequence
        times.append(sleeps[1])
    assert times == pytest.approx([0.01 + 0.002 * b + 0.0001 * 32 * b for b in (1, 4, 16)])


def test_a_second_request_sharing_a_long_prompt_prefix_gets_a_lower_modelled_prefill(make_engine):
    engine, sleeps = make_engine(max_num_batched_tokens=64)
    shared = prompt(480)
    ttft = {}
    for rid, tail in (("first", prompt(16, 5000)), ("second", prompt(16, 6000))):
        engine.add_request(EngineRequest(rid, shared + tail, GREEDY))
        start, cached = len(sleeps), None
        while cached is None:  # steps until its first token: its modelled time to first token
            for o in engine.step().outputs:
                cached = o.num_cached_tokens
        ttft[rid] = (sum(sleeps[start:]), cached)
        run(engine)
    assert ttft["first"][1] == 0 and ttft["second"][1] == 480
    assert ttft["second"][0] < ttft["first"][0] / 5


def test_same_prompt_and_seed_give_the_same_tokens_whatever_the_batch(make_engine):
    sampled = SamplingOptions(temperature=0.8, seed=7, max_tokens=12)
    alone, _ = make_engine()
    alone.add_request(EngineRequest("a", prompt(20), sampled))
    crowded, _ = make_engine()
    for i in range(5):
        crowded.add_request(EngineRequest(f"other{i}", prompt(20 + i, 3000), sampled))
    crowded.add_request(EngineRequest("a", prompt(20), sampled))
    other_seed, _ = make_engine()
    other_seed.add_request(EngineRequest("a", prompt(20), SamplingOptions(temperature=0.8, seed=8, max_tokens=12)))
    first = run(alone)["a"]
    assert run(crowded)["a"] == first and len(first[0]) == 12
    assert run(other_seed)["a"][0] != first[0]


def test_a_resumed_request_continues_the_same_tokens(make_engine):
    whole, _ = make_engine()
    whole.add_request(EngineRequest("r", prompt(20), GREEDY))
    tokens, _ = run(whole)["r"]
    resumed, _ = make_engine()
    resumed.add_request(EngineRequest("r", prompt(20), GREEDY, output_token_ids=tokens[:3]))
    assert run(resumed)["r"][0] == tokens[3:]


def test_tokens_are_plain_words_of_the_served_tokenizer(make_engine, vocab, model_dir):
    from tokenizers import Tokenizer

    engine, _ = make_engine()
    engine.add_request(EngineRequest("r", prompt(20), SamplingOptions(temperature=0.0, max_tokens=64)))
    tokens, reason = run(engine)["r"]
    assert reason == "length" and len(tokens) == 64
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    assert not special & set(tokens) and all(0 <= t < vocab.vocab_size for t in tokens)
    text = tok.decode(tokens)
    assert text.startswith(" ") and text.replace(" ", "").isalpha()


def test_eos_ends_a_request_only_after_min_tokens_and_never_with_ignore_eos(make_engine, vocab):
    engine, _ = make_engine(eos_probability=1.0)
    eos = min(vocab.eos_token_ids)
    engine.add_request(EngineRequest("stops", prompt(20), SamplingOptions(temperature=0.0, max_tokens=8, min_tokens=3)))
    engine.add_request(
        EngineRequest("ignores", prompt(20), SamplingOptions(temperature=0.0, max_tokens=8, ignore_eos=True))
    )
    out = run(engine)
    assert out["stops"] == (out["stops"][0][:3] + [eos], "stop") and eos not in out["stops"][0][:3]
    assert len(out["ignores"][0]) == 8 and eos not in out["ignores"][0] and out["ignores"][1] == "length"


def test_stop_token_ids_end_the_request_once_min_tokens_are_out(make_engine):
    engine, _ = make_engine()
    engine.add_request(EngineRequest("r", prompt(20), GREEDY))
    tokens, _ = run(engine)["r"]
    stop_at = tokens[1]
    engine.add_request(
        EngineRequest("stop", prompt(20), SamplingOptions(temperature=0.0, max_tokens=8, stop_token_ids=(stop_at,)))
    )
    engine.add_request(
        EngineRequest(
            "late", prompt(20), SamplingOptions(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=(stop_at,))
        )
    )
    out = run(engine)
    assert out["stop"] == (tokens[:2], "stop")
    assert stop_at not in out["late"][0][:4] and out["late"][0][:1] == tokens[:1]


def test_the_sim_pool_has_as_many_kv_blocks_as_the_torch_engine_on_cpu(model_dir):
    import torch
    from transformers import AutoConfig

    from services.worker.engine.kv.kv_cache import num_blocks_for_budget

    cfg = EngineConfig(kv_cache_bytes=256 << 20, block_size=16)
    expected = num_blocks_for_budget(AutoConfig.from_pretrained(str(model_dir)), 16, torch.float32, 256 << 20)
    assert kv_pool_blocks(model_dir, cfg) == expected


def test_the_engine_setting_is_torch_by_default_and_takes_sim(monkeypatch):
    from pydantic import ValidationError

    from shared.settings import WorkerSettings

    monkeypatch.delenv("CONVEYOR_ENGINE", raising=False)
    assert WorkerSettings().engine == "torch"
    monkeypatch.setenv("CONVEYOR_ENGINE", "sim")
    assert WorkerSettings().engine == "sim"
    monkeypatch.setenv("CONVEYOR_ENGINE", "vllm")
    with pytest.raises(ValidationError, match="engine"):
        WorkerSettings()


def test_simulated_logprobs_are_synthetic_but_consistent_with_the_emitted_tokens(make_engine):
    """The simulator's stand-in distribution: the word it emits (or EOS) is among the alternatives with its own
    value, the alternatives are sorted and sum to at most 1, and the same request gives the same values."""
    import math

    runs = []
    for _ in range(2):
        engine, _ = make_engine(eos_probability=0.2)
        engine.add_request(EngineRequest("a", prompt(20), SamplingOptions(temperature=0, max_tokens=40, logprobs=3)))
        engine.add_request(EngineRequest("b", prompt(20, 3000), SamplingOptions(temperature=0, max_tokens=40)))
        got: dict[str, list] = {"a": [], "b": []}
        while engine.has_unfinished():
            for o in engine.step().outputs:
                got[o.request_id] += list(zip(o.new_token_ids, o.logprobs or [None] * len(o.new_token_ids)))
        runs.append(got)
    assert runs[0] == runs[1]
    assert all(lp is None for _, lp in runs[0]["b"]), "a request that did not ask gets none"
    for token, lp in runs[0]["a"]:
        assert len(lp.top_ids) == 3 and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert sum(math.exp(v) for v in lp.top_logprobs) <= 1.0 + 1e-9
        assert token in lp.top_ids and lp.logprob == lp.top_logprobs[lp.top_ids.index(token)]


def test_a_constrained_request_on_the_sim_emits_only_tokens_its_grammar_allows(vocab, model_dir):
    from services.worker.engine.request import GrammarSpec
    from services.worker.engine.sampling.structured import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    cfg = EngineConfig(num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=64)
    structured = StructuredOutputs(model_dir / "tokenizer.json", vocab.vocab_size, vocab.eos_token_ids)
    engine = LLMEngine(
        SimRunner(TIMING, vocab, 256, sleep=lambda s: None),
        cfg,
        vocab.eos_token_ids,
        vocab.vocab_size,
        vocab.context_len,
        structured,
    )
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    for i in range(4):
        engine.add_request(
            EngineRequest(f"c{i}", prompt(20 + i), SamplingOptions(max_tokens=40, seed=i, grammar=grammar))
        )
    for rid, (tokens, reason) in run(engine).items():
        checker = EngineRequest(
            f"check-{rid}",
            prompt(5),
            SamplingOptions(max_tokens=99, grammar=grammar),
            output_token_ids=tokens[:-1] if reason == "stop" else tokens,
        )
        engine.add_request(checker)  # replays the tokens into a fresh matcher: raises if one is not allowed
        engine.abort_request(checker.request_id)
        assert reason in ("stop", "length")
