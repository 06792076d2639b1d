"""Per-request sampling: seeds, stop tokens, min/max tokens, ignore_eos."""

from __future__ import annotations

import pytest
import torch
from tests.support.engine import QUESTIONS, run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions
from shared.settings import WorkerSettings

SEEDED = SamplingOptions(
    temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1, seed=1234, max_tokens=16
)


def test_same_seed_gives_same_tokens_alone_and_in_a_batch_of_eight(make_engine, chat):
    prompt = chat("Invent a name for a new planet and describe it.")
    engine = make_engine()
    engine.add_request(EngineRequest("alone", prompt, SEEDED))
    alone, _ = run_to_completion(engine)
    for i, q in enumerate(QUESTIONS[:8]):  # others: greedy, unseeded and differently seeded
        opts = [
            SamplingOptions(temperature=0, max_tokens=12),
            SamplingOptions(temperature=1.2, max_tokens=20),
            SamplingOptions(temperature=0.7, top_k=5, seed=i, max_tokens=8),
        ][i % 3]
        engine.add_request(EngineRequest(f"other{i}", chat(q), opts))
    engine.add_request(EngineRequest("batched", prompt, SEEDED))
    batched, steps = run_to_completion(engine)
    assert max(r.num_seqs for r in steps) == 9
    assert batched["batched"].tokens == alone["alone"].tokens
    engine.check_no_leak()


def test_different_seeds_differ(make_engine, chat):
    engine = make_engine()
    prompt = chat("Invent a name for a new planet and describe it.")
    for seed in (1, 2):
        opts = SamplingOptions(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        engine.add_request(EngineRequest(f"s{seed}", prompt, opts))
    runs, _ = run_to_completion(engine)
    assert runs["s1"].tokens != runs["s2"].tokens


def test_a_negative_seed_gives_the_same_tokens_again_and_those_of_its_uint64_twin(make_engine, chat):
    """Any int64 seed is served (OpenAI's range), seeding the generator with seed % 2**64: -1 is 2**64 - 1."""
    engine = make_engine()
    prompt = chat("Invent a name for a new planet and describe it.")
    for name, seed in [("a", -(2**63)), ("b", -(2**63)), ("minus_one", -1), ("twin", 2**64 - 1)]:
        engine.add_request(EngineRequest(name, prompt, SamplingOptions(temperature=1.0, seed=seed, max_tokens=12)))
    runs, _ = run_to_completion(engine)
    assert runs["a"].tokens == runs["b"].tokens and runs["minus_one"].tokens == runs["twin"].tokens
    engine.check_no_leak()


def test_max_tokens_and_stop_token_ids(make_engine, chat, hf_reference):
    prompt = chat(QUESTIONS[2])
    expected = hf_reference(prompt, 24)
    stop = expected[5]
    first_stop = expected.index(stop)
    engine = make_engine()
    engine.add_request(EngineRequest("max", prompt, SamplingOptions(temperature=0, max_tokens=5)))
    engine.add_request(
        EngineRequest("stop", prompt, SamplingOptions(temperature=0, max_tokens=24, stop_token_ids=(stop,)))
    )
    runs, _ = run_to_completion(engine)
    assert runs["max"].tokens == expected[:5] and runs["max"].finish_reason == "length"
    assert runs["stop"].tokens == expected[: first_stop + 1], "stops on the stop token, which is included"
    assert runs["stop"].finish_reason == "stop"
    engine.check_no_leak()


def test_ignore_eos_and_min_tokens_generate_past_eos(make_engine, chat, hf_reference, tokenizer):
    prompt = chat(QUESTIONS[0])
    expected = hf_reference(prompt, 24)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert expected[-1] == eos and len(expected) < 20, "this prompt's greedy answer ends early with EOS"
    engine = make_engine()
    engine.add_request(EngineRequest("ignore", prompt, SamplingOptions(temperature=0, max_tokens=20, ignore_eos=True)))
    engine.add_request(
        EngineRequest("min", prompt, SamplingOptions(temperature=0, max_tokens=20, min_tokens=len(expected) + 2))
    )
    runs, _ = run_to_completion(engine)
    ignore, minimum = runs["ignore"], runs["min"]
    assert len(ignore.tokens) == 20 and ignore.finish_reason == "length"
    assert ignore.tokens[: len(expected)] == expected, "EOS is generated, just not a stop"
    assert minimum.tokens[: len(expected) - 1] == expected[:-1]
    assert eos not in minimum.tokens[: len(expected) + 2], "EOS masked until min_tokens outputs exist"
    assert len(minimum.tokens) >= len(expected) + 2
    engine.check_no_leak()


@pytest.mark.parametrize("native", [False, True], ids=["torch", "cpu-kernel"])
def test_draw_follows_the_distribution_and_never_picks_a_masked_token(native, kernels_dir):
    """The sampler's draw (inverse CDF over the batch) against known probabilities: 20,000 draws per row,
    two rows with different distributions in one batch; p = 0 entries (masked by top-k) never come out.
    Both the torch draw and the C++ one (csrc/sampling.cpp)."""
    from services.worker.engine.cpu import cpu_ops
    from services.worker.engine.sampling.sampler import _draw

    if native and not cpu_ops.load(kernels_dir, WorkerSettings().cpu_isa):
        pytest.skip("the CPU kernels did not build here (no C++ compiler?): the engine uses the torch draw")

    class Row:
        def __init__(self, seed: int, top_k: int):
            self.sampling = SamplingOptions(temperature=1.0, top_k=top_k)
            self.generator = torch.Generator().manual_seed(seed)

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.05, 0.05, 0.1, 0.2, 0.6]])
    rows = [Row(1, 3), Row(2, 0)]  # top_k=3 masks index 3 of row 0 as well
    counts = torch.zeros(2, 5)
    for _ in range(20000):
        for r, tok in enumerate(_draw(torch.log(probs), rows, native)):
            counts[r, tok] += 1
    freq = counts / 20000
    assert freq[0, 3] == 0 and freq[0, 4] == 0
    torch.testing.assert_close(freq[0, :3], probs[0, :3] / 0.95, atol=0.015, rtol=0)
    torch.testing.assert_close(freq[1], probs[1], atol=0.015, rtol=0)


def test_native_draw_at_a_temperature_follows_softmax_across_chunks(kernels_dir):
    """The C++ draw without filters: temperature applied inside, a vocabulary spanning several 16-token
    chunks with a ragged tail, -inf logits never drawn."""
    from services.worker.engine.cpu import cpu_ops
    from services.worker.engine.sampling.sampler import _draw

    if not cpu_ops.load(kernels_dir, WorkerSettings().cpu_isa):
        pytest.skip("the CPU kernels did not build here (no C++ compiler?): the engine uses the torch draw")

    class Row:
        def __init__(self, seed: int, temperature: float):
            self.sampling = SamplingOptions(temperature=temperature)
            self.generator = torch.Generator().manual_seed(seed)

    torch.manual_seed(0)
    logits = torch.randn(2, 37) * 2
    logits[:, 5] = float("-inf")
    logits[:, 36] = float("-inf")
    rows = [Row(3, 0.5), Row(4, 1.5)]
    counts = torch.zeros(2, 37)
    for _ in range(20000):
        for r, tok in enumerate(_draw(logits, rows, native=True)):
            counts[r, tok] += 1
    expected = torch.softmax(logits / torch.tensor([[0.5], [1.5]]), dim=-1)
    assert counts[:, 5].sum() == 0 and counts[:, 36].sum() == 0
    torch.testing.assert_close(counts / 20000, expected, atol=0.015, rtol=0)


def test_a_logit_bias_of_100_makes_a_greedy_answer_that_token_and_minus_100_bans_it(make_engine, chat):
    engine = make_engine()
    prompt = chat("Name a colour.")
    engine.add_request(EngineRequest("free", prompt, SamplingOptions(temperature=0, max_tokens=4)))
    runs, _ = run_to_completion(engine)
    first = runs["free"].tokens[0]
    forced, banned = 1000, ((first, -100.0),)
    engine.add_request(
        EngineRequest("up", prompt, SamplingOptions(temperature=0, max_tokens=4, logit_bias=((forced, 100.0),)))
    )
    engine.add_request(EngineRequest("down", prompt, SamplingOptions(temperature=0, max_tokens=4, logit_bias=banned)))
    runs, _ = run_to_completion(engine)
    assert runs["up"].tokens == [forced] * 4
    assert first not in runs["down"].tokens
    engine.check_no_leak()
