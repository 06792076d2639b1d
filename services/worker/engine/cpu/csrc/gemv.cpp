// y [M, N] = x [M, K] . w [N, K]^T (+ bias) in float32 at one to 64 rows: the decode step's linears at one to a few
// dozen sequences. Registered as torch.ops.conveyor_<isa>.gemv; gemm.py offers it to the GEMM plans as one more
// kernel, so it runs only where it measured faster than oneDNN / MKL on this CPU for that layer and row count.
//
// Why: at a few sequences a decode step reads every weight once and computes little (memory-bound); MKL's sgemm
// drew 14 GB/s over SmolLM2's 121 weights of 1.3-7 MB at 4 rows, 25 GB/s at one, where a plain read of memory
// draws ~32 GB/s on the same 2 threads (docs/benchmarks.md, issue 29). What a small weight loses in a library is
// the start of each call: the hardware prefetchers learn a new stream while the cores wait on DRAM, and a split
// into blocks of 64 outputs leaves one thread with a block more than the other. Here each thread reads one
// contiguous run of whole rows (the rows split evenly in groups of W), with software prefetches ahead from its
// first row on; a weight row comes from memory once for all x rows, and W rows' sums are reduced in one transpose.
// Two paths: at one row (avx2: up to 7) each weight row is dotted with the x rows 4 at a time while it sits in L1;
// from kBlockFromRows on, register tiles of x rows by weight rows (gemm_columns), where at 8-64 rows the
// libraries lose ~10-30 % to their blocking for large M (docs/benchmarks.md, 2026-12-02, sixth session).
// The sum of a row runs over K in W-lane partial sums, so the result differs from the libraries' in rounding only
// (the plans check it agrees with F.linear before offering it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "shares.h"
#include "vec.h"

namespace {

constexpr int64_t kGemvMaxRows = 64;  // x rows one call takes: beyond, the libraries' blocked GEMMs win anyway
// From this many x rows on, register tiles (gemm_columns, below): measured over the model's weights on the Xeon of
// docs/benchmarks.md, level with the row path at 1 row, ahead from 2 (avx512) or 8 (avx2's 16 registers) rows.
#if CONVEYOR_VEC == 16
constexpr int64_t kBlockFromRows = 2;
#else
constexpr int64_t kBlockFromRows = 8;
#endif
// Prefetch distances in cache lines, from a sweep on a 2-core Xeon (docs/benchmarks.md): into L1 16 lines ahead
// (what the next steps load), into L2 128 lines (8 KB) ahead, so that DRAM's latency is covered from a weight's
// first row on instead of after the hardware prefetchers have learnt the stream. The L2 distance is the caller's
// (`far_lines`, 0: none): on an AMD Zen 3 the same L2 prefetches cost 10-15 % at 1-4 rows (its own prefetchers
// keep up, the extra requests only queue), so gemm.py offers the plans both and they keep the faster.
constexpr int64_t kAheadLines = 16;
constexpr int64_t kFarLines = 128;  // the default of `far_lines`
constexpr int64_t kMaxFarLines = 1024;

#if defined(CONVEYOR_VEC)
using namespace conveyor_vec;

// sums[m][r] += the W-lane partial sums of x row m . w row (MC rows of x from m0), K = n floats.
template <int MC>
inline void row_dot(const float* x, int64_t xs, const float* wr, int64_t K, const float* stop, int64_t far_lines,
                    vf* acc_out) {
  vf acc[MC][2];
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = vzero();
  int64_t k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    const float* ahead = wr + k + 16 * kAheadLines;
    if (ahead < stop) {
      prefetch(ahead);
      if (W == 16) prefetch(ahead + 16);  // two lines a step (2 x 16 floats); avx2's step is one line
    }
    const float* far = wr + k + 16 * far_lines;
    if (far_lines && far < stop) {
      prefetch_l2(far);
      if (W == 16) prefetch_l2(far + 16);
    }
    const vf w0 = vload(wr + k), w1 = vload(wr + k + W);
    for (int m = 0; m < MC; ++m) {
      acc[m][0] = vfmadd(vload(x + m * xs + k), w0, acc[m][0]);
      acc[m][1] = vfmadd(vload(x + m * xs + k + W), w1, acc[m][1]);
    }
  }
  for (; k < K; k += W) {  // the tail: at most two partial steps, masked
    const auto keep = vfirst(K - k);
    const vf w0 = vload_first(wr + k, keep);
    for (int m = 0; m < MC; ++m) acc[m][0] = vfmadd(vload_first(x + m * xs + k, keep), w0, acc[m][0]);
  }
  for (int m = 0; m < MC; ++m) acc_out[m * W] = vadd(acc[m][0], acc[m][1]);
}

// Output columns [n0, n1) of every x row; n0 is a multiple of W.
void gemv_columns(const float* x, int64_t xs, int64_t M, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ys, int64_t n0, int64_t n1, int64_t far_lines) {
  const float* stop = w + n1 * K;
  for (int64_t line = 0; line < std::max(kAheadLines, far_lines); ++line) {  // the run's start, before loads wait
    const float* p = std::min(w + n0 * K + 16 * line, stop - 1);
    line < kAheadLines ? prefetch(p) : prefetch_l2(p);
  }
  vf sums[kBlockFromRows * W];  // [m][r]: x row m's partial sums for the group's row r
  for (int64_t g = n0; g < n1; g += W) {
    const int64_t rows = std::min<int64_t>(W, n1 - g);
    for (int64_t r = 0; r < W; ++r) {
      vf* at = sums + r;
      if (r >= rows) {
        for (int64_t m = 0; m < M; ++m) at[m * W] = vzero();
        continue;
      }
      const float* wr = w + (g + r) * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * xs;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: row_dot<1>(xm, xs, wr, K, stop, far_lines, at + m0 * W); break;
          case 2: row_dot<2>(xm, xs, wr, K, stop, far_lines, at + m0 * W); break;
          case 3: row_dot<3>(xm, xs, wr, K, stop, far_lines, at + m0 * W); break;
          default: row_dot<4>(xm, xs, wr, K, stop, far_lines, at + m0 * W); break;
        }
      }
    }
    const auto keep = vfirst(rows);
    for (int64_t m = 0; m < M; ++m) {
      vf out = vreduce_rows(sums + m * W);
      if (bias) out = vadd(out, vload_first(bias + g, keep));
      vstore_first(y + m * ys + g, keep, out);
    }
  }
}

// ---- More rows (kBlockFromRows and up): a register tile of MR x rows by NR weight rows, one accumulator each (K
// in the lanes), so each vector loaded feeds several FMAs (the path above loads two vectors for two FMAs per x row:
// load-bound once x has more than a few rows). A group of W weight rows is read from memory once, by the first
// tile of x rows, and from L1/L2 by the others; while a group is computed, the next one is prefetched into L2,
// spread over the group's k-steps (at a few rows the step is memory-bound, at 16-64 it computes long enough for
// the next group to arrive).
constexpr int kTileM = W == 16 ? 6 : 3;  // avx512: 6 x 4 accumulators + 4 weights + 1 x of 32 registers; avx2: 3 x 4
constexpr int kTileN = 4;

template <int MR>
inline void block_dot(const float* x, int64_t xs, const float* const* wr, int64_t K, vf* sums, const float*& pf,
                      const float* pf_end, int64_t pf_step) {
  vf acc[MR][kTileN];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < kTileN; ++n) acc[m][n] = vzero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    for (int64_t i = 0; i < pf_step && pf < pf_end; ++i, pf += 16) prefetch_l2(pf);
    vf w[kTileN];
#pragma GCC unroll 4
    for (int n = 0; n < kTileN; ++n) w[n] = vload(wr[n] + k);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const vf xv = vload(x + m * xs + k);
#pragma GCC unroll 4
      for (int n = 0; n < kTileN; ++n) acc[m][n] = vfmadd(xv, w[n], acc[m][n]);
    }
  }
  if (k < K) {  // the tail, masked
    const auto keep = vfirst(K - k);
    vf w[kTileN];
    for (int n = 0; n < kTileN; ++n) w[n] = vload_first(wr[n] + k, keep);
    for (int m = 0; m < MR; ++m) {
      const vf xv = vload_first(x + m * xs + k, keep);
      for (int n = 0; n < kTileN; ++n) acc[m][n] = vfmadd(xv, w[n], acc[m][n]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < kTileN; ++n) sums[m * W + n] = acc[m][n];
}

// Output columns [n0, n1) of every x row, by register tiles; n0 is a multiple of W.
void gemm_columns(const float* x, int64_t xs, int64_t M, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ys, int64_t n0, int64_t n1, int64_t far_lines) {
  const float* stop = w + n1 * K;
  for (int64_t line = 0; line < far_lines; ++line) prefetch_l2(std::min(w + n0 * K + 16 * line, stop - 1));
  const int64_t steps = (M + kTileM - 1) / kTileM * (W / kTileN) * ((K + W - 1) / W);  // k-steps a group takes
  const int64_t pf_step = (W * K / 16 + steps - 1) / steps;  // lines of the next group to prefetch per k-step
  vf sums[kTileM * W];  // [m][r]: x row m0 + m's partial sums for the group's row r
  for (int64_t g = n0; g < n1; g += W) {
    const int64_t rows = std::min<int64_t>(W, n1 - g);
    const auto keep = vfirst(rows);
    const float* pf = std::min(w + (g + W) * K, stop);
    const float* pf_end = std::min(w + (g + 2 * W) * K, stop);
    for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
      const float* xm = x + m0 * xs;
      const int64_t mr = std::min<int64_t>(kTileM, M - m0);
      for (int64_t r0 = 0; r0 < W; r0 += kTileN) {
        const float* wr[kTileN];  // rows past the last compute the last again (their sums are not stored)
        for (int n = 0; n < kTileN; ++n) wr[n] = w + (g + std::min<int64_t>(r0 + n, rows - 1)) * K;
        vf* at = sums + r0;
        switch (mr) {
          case 1: block_dot<1>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
          case 2: block_dot<2>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
          case 3: block_dot<3>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
#if CONVEYOR_VEC == 16
          case 4: block_dot<4>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
          case 5: block_dot<5>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
          case 6: block_dot<6>(xm, xs, wr, K, at, pf, pf_end, pf_step); break;
#endif
          default: break;
        }
      }
      for (int64_t m = 0; m < mr; ++m) {
        vf out = vreduce_rows(sums + m * W);
        if (bias) out = vadd(out, vload_first(bias + g, keep));
        vstore_first(y + (m0 + m) * ys + g, keep, out);
      }
    }
  }
}
constexpr int64_t kGroup = W;
#else
void gemv_columns(const float* x, int64_t xs, int64_t M, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ys, int64_t n0, int64_t n1, int64_t /*far_lines: no prefetches here*/) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * xs + k] * wr[k];
      y[m * ys + n] = bias ? s + bias[n] : s;
    }
  }
}
constexpr int64_t kGroup = 8;
#endif

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t far_lines) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "gemv: float32 x [M, K], rows contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "gemv: contiguous float32 w [N, K] matching x");
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "gemv: at most ", kGemvMaxRows, " rows of x, got ", x.size(0));
  TORCH_CHECK(far_lines >= 0 && far_lines <= kMaxFarLines, "gemv: far_lines in [0, ", kMaxFarLines, "], got ",
              far_lines);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                            "gemv: contiguous float32 bias [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), groups = (N + kGroup - 1) / kGroup;
  // one contiguous run of rows per thread: the even split a memory-bound pass wants
  const int64_t per_thread = (groups + conveyor_shares::kernel_threads() - 1) / conveyor_shares::kernel_threads();
  at::parallel_for(0, groups, per_thread, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kGroup, n1 = std::min(N, end * kGroup);
#if defined(CONVEYOR_VEC)
    if (M >= kBlockFromRows) return gemm_columns(xp, xs, M, wp, K, bp, yp, N, n0, n1, far_lines);
#endif
    gemv_columns(xp, xs, M, wp, K, bp, yp, N, n0, n1, far_lines);
  });
  return y;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias, int far_lines=128) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(gemv));
}
