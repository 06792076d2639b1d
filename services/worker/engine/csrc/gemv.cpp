// y [M, N] = x [M, K] . w [N, K]^T (+ bias) in float32 at a few rows: the decode step's linears at one to a few
// sequences. Registered as torch.ops.conveyor_<isa>.gemv; gemm.py offers it to the GEMM plans as one more kernel,
// so it runs only where it measured faster than oneDNN / MKL on this CPU for that layer and row count.
//
// Why: at a few sequences a decode step reads every weight once and computes little (memory-bound); MKL's sgemm
// drew 14 GB/s over SmolLM2's 121 weights of 1.3-7 MB at 4 rows, 25 GB/s at one, where a plain read of memory
// draws ~32 GB/s on the same 2 threads (docs/benchmarks.md, issue 29; this kernel: 26-27 GB/s at 1 and 4 rows,
// so a 4-sequence step is ~17 % faster; at one row its ~5 % stays under the plans' margin on that Xeon).
// What a small weight loses in a library is the start of each call:
// the hardware prefetchers learn a new stream while the cores wait on DRAM, and a split into blocks of 64 outputs
// leaves one thread with a block more than the other. Here each thread reads one contiguous run of whole rows
// (the rows split evenly in groups of W), with software prefetches ahead from its first row on (below); a weight
// row comes from memory once for all x rows (taken 4 at a time while the row sits in L1), and W rows' sums are
// reduced in one transpose.
// The sum of a row runs over K in W-lane partial sums, so the result differs from the libraries' in rounding only
// (the plans check it agrees with F.linear before offering it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace {

constexpr int64_t kGemvMaxRows = 16;  // x rows one call takes: beyond a few, oneDNN's blocked GEMM wins anyway
// Prefetch distances in cache lines, from a sweep on a 2-core Xeon (docs/benchmarks.md): into L1 16 lines ahead
// (what the next steps load), into L2 128 lines (8 KB) ahead, so that DRAM's latency is covered from a weight's
// first row on instead of after the hardware prefetchers have learnt the stream.
constexpr int64_t kAheadLines = 16;
constexpr int64_t kFarLines = 128;

#if defined(CONVEYOR_VEC)
using namespace conveyor_vec;

// sums[m][r] += the W-lane partial sums of x row m . w row (MC rows of x from m0), K = n floats.
template <int MC>
inline void row_dot(const float* x, int64_t xs, const float* wr, int64_t K, const float* stop, vf* acc_out) {
  vf acc[MC][2];
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = vzero();
  int64_t k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    const float* ahead = wr + k + 16 * kAheadLines;
    if (ahead < stop) {
      prefetch(ahead);
      if (W == 16) prefetch(ahead + 16);  // two lines a step (2 x 16 floats); avx2's step is one line
    }
    const float* far = wr + k + 16 * kFarLines;
    if (far < stop) {
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
                  int64_t ys, int64_t n0, int64_t n1) {
  const float* stop = w + n1 * K;
  for (int64_t line = 0; line < kFarLines; ++line) {  // the run's start, before the first loads wait on it
    const float* p = std::min(w + n0 * K + 16 * line, stop - 1);
    line < kAheadLines ? prefetch(p) : prefetch_l2(p);
  }
  vf sums[kGemvMaxRows * W];  // [m][r]: x row m's partial sums for the group's row r
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
          case 1: row_dot<1>(xm, xs, wr, K, stop, at + m0 * W); break;
          case 2: row_dot<2>(xm, xs, wr, K, stop, at + m0 * W); break;
          case 3: row_dot<3>(xm, xs, wr, K, stop, at + m0 * W); break;
          default: row_dot<4>(xm, xs, wr, K, stop, at + m0 * W); break;
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
constexpr int64_t kGroup = W;
#else
void gemv_columns(const float* x, int64_t xs, int64_t M, const float* w, int64_t K, const float* bias, float* y,
                  int64_t ys, int64_t n0, int64_t n1) {
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

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "gemv: float32 x [M, K], rows contiguous");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "gemv: contiguous float32 w [N, K] matching x");
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "gemv: at most ", kGemvMaxRows, " rows of x, got ", x.size(0));
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
  const int64_t per_thread = (groups + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, groups, per_thread, [&](int64_t begin, int64_t end) {
    gemv_columns(xp, xs, M, wp, K, bp, yp, N, begin * kGroup, std::min(N, end * kGroup));
  });
  return y;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(gemv));
}
