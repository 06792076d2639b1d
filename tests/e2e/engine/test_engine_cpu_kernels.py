"""The engine's C++ kernels equal their torch references (paged decode attention = gather + SDPA with GQA, ragged
lengths, sliding window; paged prefill attention = causal SDPA per sequence; the layer ops; the sampler's draw), for every ISA variant this CPU runs (cpu_ops.ISAS;
one the CPU lacks is skipped, naming the flags)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.cpu import cpu_ops


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


SHAPES = {  # (heads, kv_heads, dim, block_size, lens): vector paths (dim 32, 64, 128) and the portable one (dim 24)
    "small-blocks": (6, 2, 32, 4, [1, 4, 5, 17, 30]),  # a single key, a full block, one past it, ragged
    "smollm2": (9, 3, 64, 16, [1, 15, 16, 33, 200]),  # 8- and 16-token tiles with and without a tail
    "dim128": (8, 2, 128, 16, [7, 40]),  # the most accumulators a tile holds (spilled on avx2)
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
    kernels.paged_decode(out, q, key, value, tables, lens, block_size, dim**-0.5, window)
    expected = reference(q, key.float(), value.float(), tables, lens, block_size, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


SPLITS = {  # lens whose tokens the threads share by cutting sequences (csrc/paged_decode.cpp, plan_parts)
    "one-long": [700],  # a single stream: its tokens cut among all threads
    "long-first": [900, 40, 3, 17, 1, 260],  # the oldest and longest first, then short ones
    "cut-near-edges": [70, 70, 70, 70],  # cuts that would leave a part under the minimum
}


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("case", list(SPLITS))
def test_paged_decode_kernel_splits_sequences_among_threads_exactly(kernels, case, window, threads):
    """Sequences cut among the threads (parts computed apart, merged by their softmax maxima and sums) give the
    reference's attention, with and without a window, at two and three threads."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    lens = SPLITS[case]
    per_seq = -(-max(lens) // block_size)
    blocks = len(lens) * per_seq + 3
    key = torch.randn(blocks * block_size, kv_heads, dim)
    value = torch.randn(blocks * block_size, kv_heads, dim)
    tables = torch.randperm(blocks)[: len(lens) * per_seq].view(len(lens), per_seq)
    lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim) * 3  # peaked scores: parts' maxima differ, the merge must rescale
    out = torch.empty_like(q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.paged_decode(out, q, key, value, tables, lens, block_size, dim**-0.5, window)
    finally:
        torch.set_num_threads(before)
    expected = reference(q, key, value, tables, lens, block_size, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def prefill_reference(q, key, value, tables, spans, block_size, window):
    """Each sequence's rows: SDPA over its keys 0 .. start + len - 1 (gathered, repeated per query head), masked
    causally (and to the window) by position."""
    heads, d = q.shape[1], q.shape[2]
    kvh = key.shape[1]
    outs, row = [], 0
    for i, (start, n) in enumerate(spans.tolist()):
        keys = start + n
        blocks = tables[i, : -(-keys // block_size)]
        k = key.view(-1, block_size, kvh, d)[blocks].reshape(-1, kvh, d)[:keys].repeat_interleave(heads // kvh, 1)
        v = value.view(-1, block_size, kvh, d)[blocks].reshape(-1, kvh, d)[:keys].repeat_interleave(heads // kvh, 1)
        pos = torch.arange(start, keys)[:, None]
        j = torch.arange(keys)[None]
        mask = j <= pos
        if window:
            mask &= j > pos - window
        out = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=d**-0.5
        )
        outs.append(out.transpose(0, 1))
        row += n
    return torch.cat(outs)


PREFILL_SHAPES = {  # (heads, kv_heads, dim, block_size, spans (start, len) per sequence)
    "fresh-chunk": (9, 3, 64, 16, [(0, 200)]),  # causal within itself: several tiles and key blocks, tails
    "context-and-fresh": (9, 3, 64, 16, [(100, 37), (0, 1), (3, 300)]),  # ragged: one row, a chunk after context
    "drafted-decodes": (9, 3, 64, 16, [(1000, 5), (70, 5)]),  # a few rows over a long context
    "small-blocks": (6, 2, 32, 4, [(0, 17), (30, 5)]),
    "dim128": (8, 2, 128, 16, [(7, 40), (0, 130)]),
    "mha": (4, 4, 64, 16, [(65, 64)]),  # G = 1: a tile of 128 positions
    "odd-dim": (4, 1, 24, 8, [(3, 9), (0, 40)]),  # dim not a multiple of a vector: every path's loops have tails
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7, 70])
@pytest.mark.parametrize("shape", list(PREFILL_SHAPES))
def test_prefill_attention_kernel_equals_causal_sdpa_over_the_gathered_keys(kernels, shape, window, dtype):
    """K/V scattered over the pool in its dtype; rows of several sequences packed; the kernel computes in float32
    (the reference too, on the same rounded K/V)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, spans = PREFILL_SHAPES[shape]
    per_seq = max(-(-(start + n) // block_size) for start, n in spans)
    blocks = len(spans) * per_seq + 3
    key = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    value = torch.randn(blocks * block_size, kv_heads, dim).to(dtype)
    tables = torch.randperm(blocks)[: len(spans) * per_seq].view(len(spans), per_seq)
    spans = torch.tensor(spans, dtype=torch.long)
    q = torch.randn(int(spans[:, 1].sum()), heads, dim)
    out = torch.empty_like(q)
    kernels.prefill_attention(out, q, key, value, tables, spans, block_size, dim**-0.5, window)
    expected = prefill_reference(q, key.float(), value.float(), tables, spans, block_size, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_prefill_attention_kernel_refuses_spans_that_do_not_cover_q(kernels):
    q = torch.randn(10, 2, 16)
    key = value = torch.randn(32, 1, 16)
    with pytest.raises(RuntimeError, match="add up to q's rows"):
        kernels.prefill_attention(
            torch.empty_like(q), q, key, value, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[0, 9]]), 16, 0.25, 0
        )


def test_add_rms_norm_equals_residual_add_then_transformers_rmsnorm(kernels):
    from services.worker.engine.model.fused_llama import rms_norm

    torch.manual_seed(0)
    h, x, w = torch.randn(33, 576), torch.randn(33, 576), torch.randn(576)
    expected_h = h + x
    expected = rms_norm(expected_h, (w, 1e-5))
    out = torch.empty_like(h)
    kernels.add_rms_norm(out, h, x, w, 1e-5)
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    kernels.add_rms_norm(out, h, None, w, 1e-5)  # no add: the norm alone
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
    kernels.rotary(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, heads * d :], v_before, rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("width", [1536, 37])  # vector body only, and a scalar tail
def test_silu_mul_equals_torch(kernels, width):
    torch.manual_seed(0)
    gate_up = torch.randn(9, 2 * width) * 6
    out = torch.empty(9, width)
    kernels.silu_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


# The row path's counts and its chunks of 4 (+ 1); the register tiles' x rows from 1 to 6, whole tiles and a tail.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64])
@pytest.mark.parametrize("shape", [(576, 1536), (37, 50), (3, 7)])  # whole groups/steps; row and K tails; < 1 group
@pytest.mark.parametrize("far_lines", [128, 0, 1024])  # the default L2 prefetch distance, none (gemv_near), the most
def test_gemv_equals_f_linear_with_and_without_bias(kernels, rows, shape, far_lines):
    torch.manual_seed(0)
    n, k = shape
    w, b = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k + 3)[:, :k]  # rows strided as a view of a wider tensor
    torch.testing.assert_close(kernels.gemv(x, w, None, far_lines), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.gemv(x, w, b, far_lines), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("far_lines", [-1, 1025])
def test_gemv_refuses_a_prefetch_distance_out_of_its_range(kernels, far_lines):
    with pytest.raises(RuntimeError, match=r"far_lines in \[0, 1024\], got"):
        kernels.gemv(torch.randn(1, 8), torch.randn(4, 8), None, far_lines)


def test_gemv_refuses_more_rows_than_it_takes(kernels):
    from services.worker.engine.cpu.gemm import GEMV_MAX_ROWS

    with pytest.raises(RuntimeError, match=f"at most {GEMV_MAX_ROWS} rows"):
        kernels.gemv(torch.randn(GEMV_MAX_ROWS + 1, 8), torch.randn(4, 8), None)


# x rows: one, a tile of 4 and a tail, avx512's tiles of 8 (5-16 rows) whole and with a tail, past them, several
# tiles, and more than one block of x tiles for K = 16384 (a block is half the L2, at most 4 MB: at most 15 tiles of
# 4 rows, 7 of 8); wide: tiles of 8 past 16 rows too (panel8)
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13, 16, 17, 64, 130])
@pytest.mark.parametrize(
    "shape", [(576, 1536), (48, 16384), (97, 50), (3, 7), (60, 1)]
)  # whole panels; blocks of x; a panel tail; < 1 panel; K = 1
def test_panel_gemm_equals_f_linear_with_and_without_bias(kernels, rows, shape, wide):
    torch.manual_seed(0)
    n, k = shape
    w, b = torch.randn(n, k) * k**-0.5, torch.randn(n)  # outputs of order 1 at any K, as a model's weights give
    x = torch.randn(rows, k + 3)[:, :k]  # rows strided as a view of a wider tensor
    panels = kernels.pack_panels(w)
    torch.testing.assert_close(kernels.panel_gemm(x, panels, None, n, wide), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kernels.panel_gemm(x, panels, b, n, wide), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_panel_gemm_refuses_panels_that_do_not_match_x_or_n(kernels):
    panels = kernels.pack_panels(torch.randn(30, 8))
    with pytest.raises(RuntimeError, match="K matching x"):
        kernels.panel_gemm(torch.randn(2, 9), panels, None, 30)
    with pytest.raises(RuntimeError, match="n = 500 does not fit"):
        kernels.panel_gemm(torch.randn(2, 8), panels, None, 500)
    with pytest.raises(RuntimeError, match=r"bias \[n\]"):
        kernels.panel_gemm(torch.randn(2, 8), panels, torch.randn(29), 30)


@pytest.mark.parametrize("vocab", [1000, 37])  # whole 16-token chunks plus a tail; a vocabulary under 3 chunks
def test_sample_rows_draws_the_token_whose_cdf_interval_holds_the_uniform(kernels, vocab):
    """Given the uniforms, the draw is deterministic: the token whose interval of softmax(x / temperature)'s CDF
    holds u (float64 reference; uniforms within 1e-4 of an interval's edge are moved off it). -inf never drawn."""
    torch.manual_seed(0)
    x = torch.randn(6, vocab) * 3
    x[:, ::5] = float("-inf")
    inv_temp = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 3.0])
    cdf = torch.softmax(x.double() * inv_temp.double()[:, None], dim=-1).cumsum(-1)
    u = torch.rand(6)
    for r in range(6):  # off the edges: the kernel's float32 sums may put an edge value either side
        while (cdf[r] - u[r].double()).abs().min() < 1e-4:
            u[r] = torch.rand(1)
    expected = torch.searchsorted(cdf, u.double()[:, None], side="right").squeeze(1)
    got = kernels.sample_rows(x, inv_temp, u)
    assert got.tolist() == expected.tolist()
    assert not torch.isinf(x.gather(1, got[:, None])).any()


def test_load_makes_the_requested_variant_the_engines(kernels, request, kernels_dir):
    isa = request.node.callspec.params["kernels"]
    assert cpu_ops.load(kernels_dir, isa)
    assert cpu_ops.active_isa() == isa and cpu_ops.ops() is kernels


def test_the_avx2_gemv_is_offered_beside_avx512_only(kernels, request, kernels_dir):
    """The GEMM plans also measure the avx2 build's GEMV where avx512 is the engine's (gemm.offered): with any other
    variant loaded there is no second one."""
    from services.worker.engine.cpu import gemm

    isa = request.node.callspec.params["kernels"]
    assert cpu_ops.load(kernels_dir, isa)
    beside = cpu_ops.narrow_ops()
    if isa == "avx512":
        assert beside is cpu_ops.build("avx2", kernels_dir) and beside is not kernels
        assert {"gemv256", "gemv256_near"} <= set(gemm.offered(True))
        assert not {"gemv256", "gemv256_near"} & set(gemm.offered(False))
    else:
        assert beside is None and not {"gemv256", "gemv256_near"} & set(gemm.offered(True))


def test_prefill_attention_takes_the_kernel_only_where_a_vector_build_runs(kernels, request, kernels_dir):
    """The portable loop is slower than torch's flash kernel (docs/benchmarks.md): with it the engine keeps torch's."""
    isa = request.node.callspec.params["kernels"]
    assert cpu_ops.load(kernels_dir, isa)
    assert cpu_ops.prefill_kernel_pays() == (isa != "portable")


def test_kernels_load_where_their_builds_cannot_be_pruned(kernels_dir, monkeypatch, caplog):
    """A cache the worker may read but not change (a read-only volume) must not stop the kernels it holds loading."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine (apt-get install g++): no kernels to load")

    def refused(*_a):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(cpu_ops, "prune_builds", refused)
    monkeypatch.setattr(cpu_ops, "_built", {})  # loaded afresh, as a new worker would
    assert cpu_ops.build("portable", kernels_dir) is not None
    assert "not pruned" in caplog.text
