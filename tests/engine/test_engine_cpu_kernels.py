"""The engine's C++ paged decode attention equals gather + SDPA (GQA, ragged lengths, sliding window)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine import cpu_ops


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine (apt-get install g++): the engine uses gather + SDPA")
    if not cpu_ops.load(str(tmp_path_factory.getbasetemp().parent / "conveyor-kernels")):
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
    out = F.scaled_dot_product_attention(q.view(s, kvh, heads // kvh, d), k, v, attn_mask=mask[:, None, None],
                                         scale=d ** -0.5)
    return out.reshape(s, heads, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_decode_kernel_equals_gather_and_sdpa(kernels, window, dtype):
    """K/V in the pool's dtype; the kernel computes in float32 (the reference too, on the same rounded K/V)."""
    torch.manual_seed(0)
    seqs, heads, kv_heads, dim, block_size, blocks = 5, 6, 2, 32, 4, 40
    key = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    value = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    lens = torch.tensor([1, 4, 5, 17, 30])  # a single key, a full block, one past it, ragged
    tables = torch.randperm(blocks)[:seqs * 8].view(seqs, 8)  # scattered blocks, padded rows
    q = torch.randn(seqs, heads, dim)
    out = torch.empty_like(q)
    torch.ops.conveyor.paged_decode(out, q, key, value, tables, lens, block_size, dim ** -0.5, window)
    expected = reference(q, key.float(), value.float(), tables, lens, block_size, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
