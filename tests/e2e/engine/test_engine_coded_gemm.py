"""Weights that are coded blocks (a GGUF Q4_1 or Q8_0 tensor in float32): coded.py finds each block's scales and
codes exactly or refuses the weight, csrc/coded_recover.cpp finds the same (coded.py is its reference), and
csrc/coded_gemm.cpp equals the panel GEMM on the float32 weight to the bit,
for every ISA variant this CPU runs (the `kernels` fixture: one the CPU lacks is skipped, naming the flags)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.cpu import coded


def coded_weight(bits: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A weight made as a GGUF file's tensor is dequantized, d and m float16 numbers per 32 values of a row: Q4_1
    fl(fl(d * q) + m), q 0..15 with 0 and 15 in every block; Q8_0 fl(d * q), q -127..127 with 127 or -127 in every
    block (the block's extremes, as the quantizers make them). Returns (w, (codes, d[, m]))."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    d = (torch.rand(blocks, 1, generator=g) * 0.01 + 1e-4).half().float()
    if bits == 8:
        q = torch.randint(-127, 128, (blocks, 32), generator=g)
        q[:, 0] = 127 * torch.where(torch.rand(blocks, generator=g) < 0.5, -1, 1)
        w = d * q.float()
        return w.view(n, k), (q.to(torch.int8).view(n, k), d.view(n, k // 32))
    m = (-torch.rand(blocks, 1, generator=g) * 0.08).half().float()
    q = torch.randint(0, 16, (blocks, 32), generator=g)
    q[:, 0], q[:, 1] = 0, 15
    q = q[:, torch.randperm(32, generator=g)]
    w = d * q.float()  # two roundings, as the file's converter does
    w = w + m
    return w.view(n, k), (q.to(torch.uint8).view(n, k), d.view(n, k // 32), m.view(n, k // 32))


RECOVER = {4: coded.recover_q4, 8: coded.recover_q8}


@pytest.mark.parametrize("bits", [4, 8])
def test_recover_finds_each_blocks_scales_and_codes_exactly(bits):
    w, made = coded_weight(bits, 80, 256)  # 640 blocks: a first pass of 256, then the rest
    got = RECOVER[bits](w)
    assert got is not None and len(got) == len(made)
    for a, b in zip(got, made):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


NOT_CODED = ["float32 values", "one value off by an ulp", "its last value off by an ulp", "K not a multiple of 32"]
NOT_CODED += ["bfloat16", "a NaN", "an infinity", "a -0.0"]


def not_coded(bits: int, case: str) -> torch.Tensor:
    """A weight of coded blocks spoilt as `case` says (320 blocks: the last ones past the reference's first pass)."""
    w = coded_weight(bits, 40, 256)[0]
    if case == "float32 values":
        w = torch.randn(40, 256)
    elif case == "one value off by an ulp":
        w[3, 17] = torch.nextafter(w[3, 17], torch.tensor(1.0))
    elif case == "its last value off by an ulp":
        w[-1, -1] = torch.nextafter(w[-1, -1], torch.tensor(1.0))
    elif case == "K not a multiple of 32":
        w = w[:, :48].contiguous()
    elif case == "bfloat16":
        w = w.bfloat16()
    elif case in ("a NaN", "an infinity"):
        w[0, 0] = float("nan" if case == "a NaN" else "inf")
    else:  # rebuilt as +0.0: equal as numbers, not to the bit
        w[5] = 0.0
        w[5, 3] = -0.0
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", NOT_CODED)
def test_recover_refuses_a_weight_that_is_not_coded_blocks(bits, case):
    assert RECOVER[bits](not_coded(bits, case)) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_recover_each_blocks_scales_and_codes_as_the_reference(kernels, bits):
    w, made = coded_weight(bits, 80, 256)
    got = getattr(kernels, f"recover_q{bits}")(w)
    assert len(got) == len(made)
    for a, b in zip(got, made):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", NOT_CODED)
def test_the_kernels_refuse_a_weight_that_is_not_coded_blocks(kernels, bits, case):
    assert getattr(kernels, f"recover_q{bits}")(not_coded(bits, case)) == []


def test_the_kernels_recover_the_bundled_models_codes_as_the_reference(kernels, engine_model):
    """The first layer's seven weights and the embedding: the codes, scales and offsets the reference finds."""
    layer = engine_model.model.layers[0]
    weights = [(4, m.weight.detach()) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    weights.append((8, engine_model.get_input_embeddings().weight.detach()))
    assert len(weights) == 8
    for bits, w in weights:
        got, want = getattr(kernels, f"recover_q{bits}")(w), RECOVER[bits](w)
        assert want is not None and len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_q4_weight_is_not_taken_for_q8_codes():
    assert coded.recover_q8(coded_weight(4, 16, 64)[0]) is None


# whole panels, a panel tail, < 1 panel; x tiles of 1, 2, 4 and 8 rows with their tails; several x blocks (K 4,096);
# x's rows strided (a view of a wider tensor: the GEMMs read them in place)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 17, 64, 130])
@pytest.mark.parametrize("shape", [(96, 64), (37, 96), (700, 1536), (40, 4096)])
def test_coded_gemm_equals_the_panel_gemm_on_the_float32_weight_to_the_bit(kernels, bits, rows, shape):
    n, k = shape
    w, made = coded_weight(bits, n, k, seed=rows)
    x, b = torch.randn(rows, k + 5)[:, :k], torch.randn(n)
    records, panels = getattr(kernels, f"pack_q{bits}")(*made), kernels.pack_panels(w)
    for bias in (None, b):
        got = kernels.coded_gemm(x, records, bias, n, bits)
        torch.testing.assert_close(got, kernels.panel_gemm(x, panels, bias, n, rows > 4), rtol=0, atol=0)
        # and F.linear's within float32's rounding over K terms of the weight's size (MKL sums in another order)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4 * float(w.abs().max()) * k**0.5)


# the threads share a call's panels out in chunks and take each other's once done (csrc/shares.h): 3 and 5 threads
# on the 2 cores here are preempted mid-call, so some take others' chunks; several x blocks at K = 4,096
@pytest.mark.parametrize("rows", [3, 32, 130])
def test_the_gemms_compute_every_panel_once_whatever_the_thread_count(kernels, rows):
    n, k = 700, 4096
    w, made = coded_weight(8, n, k, seed=rows)
    x = torch.randn(rows, k)
    records, panels = kernels.pack_q8(*made), kernels.pack_panels(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = kernels.coded_gemm(x, records, None, n, 8), kernels.panel_gemm(x, panels, None, n, False)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for _ in range(4):
                got = kernels.coded_gemm(x, records, None, n, 8), kernels.panel_gemm(x, panels, None, n, False)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)


def test_coded_gemm_refuses_records_that_do_not_match_x_n_or_bits(kernels):
    w, (codes, d, m) = coded_weight(4, 30, 64)
    records = kernels.pack_q4(codes, d, m)
    with pytest.raises(RuntimeError, match="K matching x"):
        kernels.coded_gemm(torch.randn(2, 96), records, None, 30, 4)
    with pytest.raises(RuntimeError, match="K matching x"):
        kernels.coded_gemm(torch.randn(2, 64), records, None, 30, 8)  # a Q4 record's size is not a Q8 one's
    with pytest.raises(RuntimeError, match="not 4 or 8"):
        kernels.coded_gemm(torch.randn(2, 64), records, None, 30, 5)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.coded_gemm(torch.randn(2, 64), records, None, 500, 4)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.coded_gemm(torch.randn(2, 64), records, torch.randn(29), 30, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_q4(codes[:, :40].contiguous(), d[:, :1].contiguous(), m[:, :1].contiguous())


def test_the_bundled_models_linears_are_q4_blocks_and_its_embedding_q8_blocks(engine_model):
    """What the GEMM on codes is for: the default SmolLM2 (converted from its Q4_1 GGUF file) has every linear weight
    as 4-bit blocks and its embedding, the tied LM head, as 8-bit ones; a change to the conversion that lost them
    would leave the engine reading five times the bytes."""
    linears = [
        m for name, m in engine_model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    ]
    assert len(linears) == 7 * engine_model.config.num_hidden_layers
    assert all(coded.recover_q4(m.weight.detach()) is not None for m in linears)
    assert coded.recover_q8(engine_model.get_input_embeddings().weight.detach()) is not None
