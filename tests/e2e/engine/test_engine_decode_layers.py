"""A decode-only step's layers in one C++ call (csrc/decode_layers.cpp) give the bits of the Python loop they replace
(fused_llama.FusedLlama._native_layers), whichever kernel the GEMM plans give the linears; steps with prefill rows
keep the Python loop. (Biases and sliding windows: test_engine_architectures runs Qwen2 and Mistral through it.)"""

from __future__ import annotations

import pytest
import torch
from tests.support.engine import run_to_completion

from services.worker.engine import EngineRequest, SamplingOptions, cpu_ops, gemm


def stacked_engine(make_engine):
    engine = make_engine()
    fused = engine.runner.fused
    if fused is None or not fused.stacked:
        pytest.skip("no decode_layers here: the engine's CPU kernels did not load (see test_engine_cpu_kernels)")
    return engine, fused


def spy_on_the_stack(fused) -> list[bool]:
    """Every decode-only step runs the Python loop first (on a copy of the residual stream), then the C++ call;
    the list gets whether the two agree to the bit. The second K/V write puts the same values in the same slots."""
    agreed: list[bool] = []
    stacked, loop = fused._stacked_layers, fused._native_layers

    def both(h, cos, sin, meta):
        expected = loop(h.clone(), cos, sin, meta)
        out = stacked(h, cos, sin, meta)
        agreed.append(torch.equal(out, expected))
        return out

    fused._stacked_layers = both
    return agreed


def add_ragged_requests(engine, n: int = 3) -> None:
    for i in range(n):
        prompt = [(37 * i + 11 * j) % 5000 + 100 for j in range(5 + 17 * i)]  # 5, 22, 39 tokens: ragged contexts
        engine.add_request(
            EngineRequest(f"r{i}", prompt, SamplingOptions(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True))
        )


@pytest.mark.parametrize("kernel", list(gemm.KERNELS))
def test_decode_layers_equal_the_python_loop_to_the_bit_with_every_gemm_kernel(make_engine, kernel):
    engine, fused = stacked_engine(make_engine)
    if kernel not in gemm.offered(gemv=cpu_ops.vector_path()):
        pytest.skip(f"the GEMM plans do not offer {kernel} on this CPU/build")
    for linear in fused.linears()[:-1]:
        gemm.apply_plan(linear, gemm.Plan((kernel,)))
    agreed = spy_on_the_stack(fused)
    add_ragged_requests(engine)
    run_to_completion(engine)
    assert len(agreed) >= 6  # decode-only steps at 3, 2 and 1 rows
    assert all(agreed)


def test_steps_with_prefill_rows_keep_the_python_loop(make_engine):
    engine, fused = stacked_engine(make_engine)
    calls: list[tuple[str, int]] = []

    def counted(name, layers):
        def run(h, cos, sin, meta):
            calls.append((name, h.shape[0]))
            return layers(h, cos, sin, meta)

        return run

    fused._native_layers = counted("loop", fused._native_layers)
    fused._stacked_layers = counted("stack", fused._stacked_layers)
    add_ragged_requests(engine, n=2)
    engine.step()  # both prompts (5 and 22 tokens): a prefill step
    engine.step()  # two decode rows
    assert calls == [("loop", 27), ("stack", 2)]
