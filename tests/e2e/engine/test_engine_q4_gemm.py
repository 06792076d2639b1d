"""Weights that are 4-bit blocks (a GGUF Q4_1 tensor in float32): q4.recover finds each block's d, m and codes
exactly or refuses the weight, and csrc/q4_gemm.cpp equals the panel GEMM on the float32 weight to the bit, for
every ISA variant this CPU runs (the `kernels` fixture: one the CPU lacks is skipped, naming the flags)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine import q4


def q4_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight made as a Q4_1 tensor is dequantized: fl(fl(d * q) + m), d and m float16 numbers per 32 values of a
    row, q 0..15 with 0 and 15 in every block (the block's smallest and largest value, as the quantizer makes
    them). Returns (w, codes, d, m)."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    d = (torch.rand(blocks, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(blocks, 1, generator=g) * 0.08).half().float()
    codes = torch.randint(0, 16, (blocks, 32), generator=g)
    codes[:, 0], codes[:, 1] = 0, 15
    codes = codes[:, torch.randperm(32, generator=g)]
    w = d * codes.float()  # two roundings, as the file's converter does
    w = w + m
    return w.view(n, k), codes.to(torch.uint8).view(n, k), d.view(n, k // 32), m.view(n, k // 32)


def test_recover_finds_each_blocks_d_m_and_codes_exactly():
    w, codes, d, m = q4_weight(48, 96)
    got = q4.recover(w)
    assert got is not None
    torch.testing.assert_close(got[0], codes, rtol=0, atol=0)
    torch.testing.assert_close(got[1], d, rtol=0, atol=0)
    torch.testing.assert_close(got[2], m, rtol=0, atol=0)


@pytest.mark.parametrize(
    "case", ["float32 values", "one value off by an ulp", "K not a multiple of 32", "bfloat16", "a NaN"]
)
def test_recover_refuses_a_weight_that_is_not_4_bit_blocks(case):
    w = q4_weight(16, 64)[0]
    if case == "float32 values":
        w = torch.randn(16, 64)
    elif case == "one value off by an ulp":
        w[3, 17] = torch.nextafter(w[3, 17], torch.tensor(1.0))
    elif case == "K not a multiple of 32":
        w = w[:, :48].contiguous()
    elif case == "bfloat16":
        w = w.bfloat16()
    else:
        w[0, 0] = float("nan")
    assert q4.recover(w) is None


# whole panels, a panel tail, < 1 panel; x tiles of 1, 2, 4 and 8 rows with their tails; several x blocks (K 4,096)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 17, 64, 130])
@pytest.mark.parametrize("shape", [(96, 64), (37, 96), (700, 1536), (40, 4096)])
def test_q4_gemm_equals_the_panel_gemm_on_the_float32_weight_to_the_bit(kernels, rows, shape):
    n, k = shape
    w, codes, d, m = q4_weight(n, k, seed=rows)
    x, b = torch.randn(rows, k), torch.randn(n)
    records, panels = kernels.pack_q4(codes, d, m), kernels.pack_panels(w)
    for bias in (None, b):
        got = kernels.q4_gemm(x, records, bias, n)
        torch.testing.assert_close(got, kernels.panel_gemm(x, panels, bias, n, rows > 4), rtol=0, atol=0)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)


def test_q4_gemm_refuses_records_that_do_not_match_x_or_n(kernels):
    w, codes, d, m = q4_weight(30, 64)
    records = kernels.pack_q4(codes, d, m)
    with pytest.raises(RuntimeError, match="K matching x"):
        kernels.q4_gemm(torch.randn(2, 96), records, None, 30)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.q4_gemm(torch.randn(2, 64), records, None, 500)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.q4_gemm(torch.randn(2, 64), records, torch.randn(29), 30)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_q4(codes[:, :40].contiguous(), d[:, :1].contiguous(), m[:, :1].contiguous())
