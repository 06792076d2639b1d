"""The engine's C++ paged decode attention equals gather + SDPA (GQA, ragged lengths, sliding window)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine import cpu_ops


@pytest.fixture(scope="module")
def kernels(kernels_dir):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine (apt-get install g++): the engine uses gather + SDPA")
    if not cpu_ops.load(kernels_dir):
        pytest.fail("a C++ compiler is present but the CPU kernels did not build (see the warning above)")


def reference(q, key, value, tables, lens, block_size, window):
    s, heads, d = q.shape
    kvh = key.shape[1]
    mb = tables.shape[1]
    k = key.view(-1, block_size, kvh, d)[tables].view(s, mb * block_size, kvh, d).transpose(1, 2)
    v = value.view(-1, block_size, kvh, d)[tables].view(s, mb * block_size, kvh, d).transpose(1, 2)
    pos = (lens - 1)[:, None]
    j = torch.arange(mb * block_size)[None]
    mask = j <= pos
    if window:
        mask &= j > pos - window
    out = F.scaled_dot_product_attention(
        q.view(s, kvh, heads // kvh, d), k, v, attn_mask=mask[:, None, None], scale=d**-0.5
    )
    return out.reshape(s, heads, d)


SHAPES = {  # (heads, kv_heads, dim, block_size, lens): vector path (dim % 16 == 0) and portable path (dim 24)
    "small-blocks": (6, 2, 32, 4, [1, 4, 5, 17, 30]),  # a single key, a full block, one past it, ragged
    "smollm2": (9, 3, 64, 16, [1, 15, 16, 33, 200]),  # 16-token tiles with and without a tail
    "portable": (4, 1, 24, 8, [3, 9, 40]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_decode_kernel_equals_gather_and_sdpa(kernels, shape, window, dtype):
    """K/V in the pool's dtype; the kernel computes in float32 (the reference too, on the same rounded K/V)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, lens = SHAPES[shape]
    per_seq = -(-max(lens) // block_size)
    blocks = len(lens) * per_seq + 3
    key = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    value = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    tables = torch.randperm(blocks)[: len(lens) * per_seq].view(len(lens), per_seq)  # scattered blocks, padded rows
    lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim)
    out = torch.empty_like(q)
    torch.ops.conveyor.paged_decode(out, q, key, value, tables, lens, block_size, dim**-0.5, window)
    expected = reference(q, key.float(), value.float(), tables, lens, block_size, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_equals_residual_add_then_transformers_rmsnorm(kernels):
    from services.worker.engine.fused_llama import rms_norm

    torch.manual_seed(0)
    h, x, w = torch.randn(33, 576), torch.randn(33, 576), torch.randn(576)
    expected_h = h + x
    expected = rms_norm(expected_h, (w, 1e-5))
    out = torch.empty_like(h)
    torch.ops.conveyor.add_rms_norm(out, h, x, w, 1e-5)
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.ops.conveyor.add_rms_norm(out, h, None, w, 1e-5)  # no add: the norm alone
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rotary_in_place_equals_transformers_rotate_half_on_a_strided_view(kernels):
    torch.manual_seed(0)
    t, heads, d = 7, 12, 64
    packed = torch.randn(t, (heads + 3) * d)  # like the qkv GEMM's output: q and k heads, then v
    cos, sin = torch.randn(t, d), torch.randn(t, d)
    qk = packed[:, : heads * d].view(t, heads, d)
    x1, x2 = qk[..., : d // 2], qk[..., d // 2 :]
    expected = qk * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    v_before = packed[:, heads * d :].clone()
    torch.ops.conveyor.rotary(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, heads * d :], v_before, rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("width", [1536, 37])  # vector body only, and a scalar tail
def test_silu_mul_equals_torch(kernels, width):
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * width) * 6
    out = torch.empty(9, width)
    torch.ops.conveyor.silu_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)
