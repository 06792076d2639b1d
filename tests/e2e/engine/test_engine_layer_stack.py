"""A step's layers in one C++ call (csrc/layer_stack.cpp) give the bits of the Python loop they replace
(fused_llama.FusedLlama._native_layers): decode steps with whichever kernel the GEMM plans give the linears, prefill
steps, chunks that continue a cached context beside decode rows, and drafted rows; a decode step split into runs of
sequences, one a thread; a step whose attention is not all in the CPU kernels keeps the Python loop. (Biases and sliding windows: test_engine_architectures runs Qwen2
and Mistral through it.)"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from tests.support.engine import run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions
from services.worker.engine.cpu import cpu_ops, gemm

REPEAT = "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon."


def stacked_engine(make_engine, **config):
    engine = make_engine(**config)
    fused = engine.runner.fused
    if fused is None or not fused.stacked:
        pytest.skip("no layer_stack here: the engine's CPU kernels did not load (see test_engine_cpu_kernels)")
    return engine, fused


def spy_on_the_stack(fused) -> list[tuple[int, bool]]:
    """Every step through the stack runs the Python loop first (on a copy of the residual stream), then the C++
    call; the list gets (rows, whether the two agree to the bit). The second K/V write puts the same values in the
    same slots."""
    seen: list[tuple[int, bool]] = []
    stacked, loop = fused._stacked_layers, fused._native_layers

    def both(h, cos, sin, meta, keep=None):
        h_loop = h.clone()
        expected = loop(h_loop, cos, sin, meta, keep)
        out = stacked(h, cos, sin, meta, keep)
        seen.append((h.shape[0], torch.equal(out, expected) and torch.equal(h, h_loop)))
        return out

    fused._stacked_layers = both
    return seen


def add_ragged_requests(engine, n: int = 3, prompt_step: int = 17) -> None:
    for i in range(n):
        prompt = [(37 * i + 11 * j) % 5000 + 100 for j in range(5 + prompt_step * i)]  # ragged contexts
        engine.add_request(
            EngineRequest(f"r{i}", prompt, SamplingOptions(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True))
        )


# q8 reads 8-bit codes, which the default SmolLM2 has in its LM head only (outside the stack); its layers' codes are
# 4-bit (q4): test_engine_coded_gemm.py checks both kernels against the panel GEMM
@pytest.mark.parametrize("kernel", [n for n in gemm.KERNELS if n != "q8"])
def test_the_stack_equals_the_python_loop_to_the_bit_with_every_gemm_kernel(make_engine, kernel):
    engine, fused = stacked_engine(make_engine)
    if kernel not in gemm.offered(gemv=cpu_ops.vector_path()):
        pytest.skip(f"the GEMM plans do not offer {kernel} on this CPU/build")
    for linear in fused.linears()[:-1]:  # the kernel up to 64 rows (the GEMV's most), F.linear beyond
        gemm.apply_plan(linear, gemm.Plan((kernel,) * 7 + ("linear",)))
    seen = spy_on_the_stack(fused)
    add_ragged_requests(engine)
    run_to_completion(engine)
    assert [rows for rows, _ in seen][:4] == [66, 3, 3, 3]  # the prompts' step, then decode steps at 3, 2, 1 rows
    assert all(equal for _, equal in seen)


def test_chunks_continuing_a_context_beside_decode_rows_equal_the_python_loop(make_engine):
    engine, fused = stacked_engine(make_engine, max_num_batched_tokens=32)  # 5/39/73-token prompts in chunks
    seen = spy_on_the_stack(fused)
    add_ragged_requests(engine, prompt_step=34)
    run_to_completion(engine)
    assert len({rows for rows, _ in seen}) > 3 and all(equal for _, equal in seen)


def test_drafted_rows_equal_the_python_loop(make_engine, chat):
    engine, fused = stacked_engine(make_engine, spec_ngram_tokens=4)
    seen = spy_on_the_stack(fused)
    engine.add_request(EngineRequest("r", chat(REPEAT), SamplingOptions(temperature=0, max_tokens=32)))
    run_to_completion(engine)
    assert engine.stats().num_drafted > 0 and all(equal for _, equal in seen)
    assert any(rows > 1 for rows, _ in seen[1:])  # decode steps with drafted rows went through the stack


def test_a_step_whose_prefill_attention_runs_in_torch_keeps_the_python_loop(make_engine):
    engine, fused = stacked_engine(make_engine)
    engine.runner.prefill_kernel = False  # prefill chunks through torch's attention: no spans for the kernel
    calls: list[tuple[str, int]] = []

    def counted(name, layers):
        def run(h, cos, sin, meta, keep=None):
            calls.append((name, h.shape[0]))
            return layers(h, cos, sin, meta, keep)

        return run

    fused._native_layers = counted("loop", fused._native_layers)
    fused._stacked_layers = counted("stack", fused._stacked_layers)
    add_ragged_requests(engine, n=2)
    engine.step()  # both prompts (5 and 22 tokens): a prefill step
    engine.step()  # two decode rows
    assert calls == [("loop", 27), ("stack", 2)]


def test_past_its_attention_the_last_layer_runs_on_the_logits_rows_only(make_engine):
    """A prefill chunk's rows but a prompt's last are read by nothing after the last layer's attention (their K/V
    are written by then): its o projection and MLP run on the rows the LM head reads, in the loop and the stack."""
    engine, fused = stacked_engine(make_engine)
    last = fused.layers[-1]
    rows: list[int] = []
    down = last.down.forward
    last.down.forward = lambda x: rows.append(x.shape[0]) or down(x)  # the loop's call (the stack's is in C++)
    seen = spy_on_the_stack(fused)
    add_ragged_requests(engine)  # 5, 22 and 39 tokens: one 66-row prefill step, then decode steps
    run_to_completion(engine)
    assert rows[:2] == [3, 3]  # the prompts' step: three logits rows of 66; the first decode step: all three
    assert all(equal for _, equal in seen)


def test_a_profile_of_a_step_names_each_stage_of_the_stack(make_engine):
    """To the dispatcher the stack is one op: the stages inside it are profiler ranges of their own, so that
    torch.profiler (benchmarks.engine.engine_profile --profile) says where a step's time goes."""
    engine, _ = stacked_engine(make_engine)
    add_ragged_requests(engine, n=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()  # the prompts
        engine.step()  # a decode step
    stages = {e.key for e in prof.key_averages() if e.key.startswith("layer_stack.")}
    assert stages == {
        f"layer_stack.{name}"
        for name in (
            "qkv_proj",
            "rotary_kv_write",
            "attention",
            "o_proj",
            "norm",
            "gate_up_proj",
            "silu_mul",
            "down_proj",
        )
    }


@pytest.fixture
def threads():
    """The engine tests run torch on one thread; a split decode step needs more (a run a thread)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def add_short_requests(engine, n: int) -> None:
    """n greedy requests of 3 to 33 prompt tokens (3, 5, ..., 33, then again): no context reaches the 64 tokens past
    which the decode kernel splits one sequence between threads, so the loop's attention and each run's take the
    same sums; and their prompts' step is short (it runs on the test's two threads, beside make test's other
    processes)."""
    for i in range(n):
        prompt = [(53 * i + 7 * j) % 5000 + 100 for j in range(3 + 2 * (i % 16))]
        engine.add_request(
            EngineRequest(f"s{i}", prompt, SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True))
        )


def attention_calls_a_step(engine, steps: int) -> list[int]:
    """Each of the next steps' calls of the stack's attention stage (a run of the stack calls it once a layer)."""
    calls = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        calls.append(sum(e.count for e in prof.key_averages() if e.key == "layer_stack.attention"))
    return calls


def test_a_decode_step_of_sixteen_sequences_split_in_two_runs_equals_the_python_loop_to_the_bit(make_engine, threads):
    threads(2)
    engine, fused = stacked_engine(make_engine, decode_split_rows=8)
    seen = spy_on_the_stack(fused)
    add_short_requests(engine, 16)
    run_to_completion(engine)
    assert [rows for rows, _ in seen][:3] == [288, 16, 16]  # the prompts' step, then decode steps of 16 rows
    assert all(equal for _, equal in seen)


@pytest.mark.parametrize(
    ("sequences", "split_rows", "n_threads", "runs"),
    [(16, 8, 2, 2), (15, 8, 2, 1), (16, 0, 2, 1), (32, 8, 2, 2), (32, 8, 4, 4), (24, 8, 4, 1)],
    ids=[
        "16-rows-in-runs-of-8",
        "fewer-than-two-runs-whole",
        "split-off",
        "runs-one-a-thread",
        "four-threads-four-runs",
        "fewer-runs-than-threads-whole",
    ],
)
def test_a_decode_step_runs_the_stack_once_per_run_of_at_least_split_rows_sequences(
    make_engine, threads, sequences, split_rows, n_threads, runs
):
    threads(n_threads)
    engine, fused = stacked_engine(make_engine, decode_split_rows=split_rows, max_num_batched_tokens=2048)
    add_short_requests(engine, sequences)  # every prompt in the first step
    prompts, decode = attention_calls_a_step(engine, 2)
    layers = len(fused.layers)
    assert (prompts, decode) == (layers, runs * layers)  # a step with prompt rows is never split
