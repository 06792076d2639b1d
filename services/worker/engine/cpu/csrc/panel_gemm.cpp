// y [M, N] = x [M, K] . w [N, K]^T (+ bias) in float32, with the weight held in panels of kPanelCols output columns,
// each panel K-major ([P, K, kPanelCols]: pack_panels): the classic GEMM register tile (as in BLIS and oneDNN) of
// kPanelRows x rows by one panel's columns, each x value broadcast against kPanelCols / W weight vectors. Registered
// as torch.ops.conveyor_<isa>.pack_panels / panel_gemm; gemm.py offers it to the GEMM plans as the `panel` kernel,
// with the packed copy of the weight it needs (memory for speed, like oneDNN's `packed`).
//
// Why: csrc/gemv.cpp dots each weight row with x rows, K in the lanes: at 8-128 rows every k-step loads as many x
// vectors as it has tile rows, from L2 (x outgrows L1 from a few dozen rows), and ends with a transpose of the sums.
// Here a k-step loads kPanelCols / W weight vectors and broadcasts kPanelRows x values for 3 x kPanelRows FMAs, and
// the panel (K x kPanelCols floats) is read from memory once and reused from L1/L2 by every tile of x rows, while the
// next panel is prefetched, spread over the tiles. Over SmolLM2's 121 weights on the 2-core Zen 3 of
// docs/benchmarks.md (huge pages, as the engine runs): 15-20 % faster than gemv.cpp at 8-64 rows, ~35 % faster than
// MKL's sgemm at 128 rows; level with the GEMV at 1-4 rows; MKL ahead from ~512 rows (plans measure, not guess).
//
// x is read in place, in tiles of kPanelRows rows (avx512: kWideRows at 5-16 rows; only a last tile that x does
// not fill is copied, zero rows past M: XRows); blocks of x rows are sized so a block's tiles stay in L2 while the
// thread's panels stream by. Each thread starts on one contiguous run of panels and takes the others' last panels
// once done (shares.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "shares.h"
#include "vec.h"

namespace {

#if defined(CONVEYOR_VEC)
constexpr int64_t kPanelCols = 3 * conveyor_vec::W;  // three vectors: 12 accumulators + 3 weights + 1 x of 16 (avx2)
// avx512's 32 registers also hold a tile of 8 rows (24 accumulators): twice the FMAs per weight vector loaded, half
// the panel's reads from L2. Side by side in one run on the Zen 4 of docs/benchmarks.md (benchmarks.gemv --baseline)
// it was 1.13-1.34x the 4-row tile at 8-16 x rows, but 2-4 % behind at 1-4 and 32 rows and 4-9 % at 64; on the
// Xeon (two 512-bit FMAs a cycle, so the 4-row tile's panel reads from L2 hold it back) 8 % ahead at 32 rows, 2 % at
// 64, 9-12 % at 128-512. So the default takes it for 5-16 rows, `wide` (gemm_kernels' panel8) beyond too: the plans
// measure which.
constexpr int64_t kWideRows = conveyor_vec::W == 16 ? 8 : 4, kWideMaxRows = 16;
#else
constexpr int64_t kPanelCols = 8;
constexpr int64_t kWideRows = 4, kWideMaxRows = 0;
#endif
constexpr int64_t kPanelRows = 4;
// The x tiles of one block: half of this CPU's L2 (the C library's figure; 256 KB, half of a Zen 3's, where it has
// none), so that a block's tiles stay in L2 while the thread's panels stream by, and the weight is read from memory
// once per block. Why not a fixed 256 KB: on the Xeon of docs/benchmarks.md (2 MB of L2) 64-128 x rows took 2-4
// blocks, each reading every weight again; with half its L2 the 8-row tiles were 4-9 % faster over the model's
// weights at 64-128 rows, level at 32 and 256 (benchmarks.gemv --baseline, one process, 2026-12-05).
inline int64_t x_block_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? std::clamp<int64_t>(l2 / 2, 128 << 10, 4 << 20) : int64_t{256} << 10;
  }();
  return bytes;
}
// One tile's prefetch distance (floats: 16 cache lines, as gemv.cpp's kAheadLines): on the Zen 3 at 1-2 rows level
// with the GEMV, where prefetching the whole next panel (the several tiles' way) ran 8 % slower: 55-147 KB ahead
// of the reads, it left L1 before it was used. 8 and 48 lines within the noise of 16, none 3-8 % slower.
constexpr int64_t kStreamAhead = 16 * 16;

// w [N, K] -> [P, K, kPanelCols], P = ceil(N / kPanelCols), columns past N zero.
at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "pack_panels: float32 w [N, K]");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kPanelCols - 1) / kPanelCols;
  at::Tensor out = at::zeros({P, K, kPanelCols}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanelCols && p * kPanelCols + j < N; ++j) {
        const float* row = src + (p * kPanelCols + j) * K;
        float* col = dst + p * K * kPanelCols + j;
        for (int64_t k = 0; k < K; ++k) col[k * kPanelCols] = row[k];
      }
  });
  return out;
}

#if defined(CONVEYOR_VEC)
using namespace conveyor_vec;
constexpr int kVecs = kPanelCols / W;

// c [R, kPanelCols] = a tile [K, R] . panel [K, kPanelCols], prefetching into L1 on the way:
//   kStream false (several tiles share the panel): `lines` cache lines from pf, the next panel's share of this tile;
//   kStream true (the panel's only tile: it streams from memory as it is read): pf follows kStreamAhead floats ahead
//   of the reads, up to `stop` (on into the next panel: they are contiguous), and is left where it got to.
template <bool kStream, int64_t R>
inline void tile(const float* a, int64_t as, const float* panel, int64_t K, float* c, const float*& pf, int64_t lines,
                 const float* stop) {
  vf acc[R][kVecs];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) acc[m][v] = vzero();
  const int64_t every = lines ? std::max<int64_t>(1, K / lines) : K + 1;  // k-steps between two prefetches
  for (int64_t k = 0, until = 1; k < K; ++k) {
    if (kStream) {
      for (const float* want = std::min(panel + k * kPanelCols + kStreamAhead, stop); pf < want; pf += 16) prefetch(pf);
    } else if (--until == 0) {
      until = every;
      if (lines-- > 0) prefetch(pf), pf += 16;
    }
    vf b[kVecs];
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) b[v] = vload(panel + k * kPanelCols + v * W);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const vf xv = vset1(a[m * as + k]);
#pragma GCC unroll 3
      for (int v = 0; v < kVecs; ++v) acc[m][v] = vfmadd(xv, b[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) vstore(c + m * kPanelCols + v * W, acc[m][v]);
}
#else
template <bool kStream, int64_t R>
inline void tile(const float* a, int64_t as, const float* panel, int64_t K, float* c, const float*& /*pf*/,
                 int64_t /*lines*/, const float* /*stop*/) {
  for (int64_t i = 0; i < R * kPanelCols; ++i) c[i] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < R; ++m)
      for (int64_t j = 0; j < kPanelCols; ++j) c[m * kPanelCols + j] += a[m * as + k] * panel[k * kPanelCols + j];
}
#endif

// out [cols] = c (+ bias)
inline void store_row(float* out, const float* c, const float* bias, int64_t cols) {
#if defined(CONVEYOR_VEC)
  if (cols == kPanelCols) {
    for (int v = 0; v < kVecs; ++v) vstore(out + v * W, bias ? vadd(vload(c + v * W), vload(bias + v * W)) : vload(c + v * W));
    return;
  }
#endif
  for (int64_t j = 0; j < cols; ++j) out[j] = c[j] + (bias ? bias[j] : 0.f);
}

// The x rows a tile multiplies: tile t's R rows in place in x (row stride xs), or for a last tile that x's rows do
// not fill, its copy `tail` (R rows of K, rows past M zero). Why in place: packing x into K-major tiles was a
// serial copy before each call's threads started (49 K floats for the down projection at 32 rows), while the other
// thread waited; the tile's broadcasts read one value of each of its rows a k-step either way, each row's line
// serving 16 k-steps.
struct XRows {
  const float* x;
  int64_t xs, full, K;  // full: tiles wholly inside x
  const float* tail;
  const float* rows(int64_t t, int64_t R) const { return t < full ? x + t * R * xs : tail; }
  int64_t stride(int64_t t) const { return t < full ? xs : K; }
};

// x's rows as tiles of R (both GEMMs'); `tail` holds the last tile's copy while the call runs.
template <int64_t R>
XRows x_rows(const at::Tensor& x, at::Tensor& tail) {
  const int64_t M = x.size(0), K = x.size(1), full = M / R;
  if (full * R < M) {  // rows past M zero; a plain loop: ATen's ops cost more to dispatch than this copy at 1-4 rows
    tail = at::empty({R, K}, x.options());
    float* tp = tail.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    for (int64_t m = 0; m < R; ++m)
      for (int64_t k = 0; k < K; ++k) tp[m * K + k] = full * R + m < M ? xp[(full * R + m) * x.stride(0) + k] : 0.f;
  }
  return XRows{x.data_ptr<float>(), x.stride(0), full, K, tail.defined() ? tail.data_ptr<float>() : nullptr};
}

// Panels [p0, p1) against x tiles [t0, t1) of R rows: y rows and columns they cover (with bias), the next panel
// prefetched, up to panel `limit` (the thread reads on in order up to there: shares.h).
template <int64_t R>
void panel_run(const XRows& xr, const float* w, int64_t K, int64_t M, int64_t N, const float* bias, float* y,
               int64_t t0, int64_t t1, int64_t p0, int64_t p1, int64_t limit) {
  alignas(64) float c[R * kPanelCols];
  const int64_t panel_floats = K * kPanelCols, lines = panel_floats / 16;
  const float* last = w + limit * panel_floats - 16;  // prefetches stay inside the thread's run
  const float* stream = w + p0 * panel_floats;  // one tile: how far the prefetches have got
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * panel_floats;
    const int64_t cols = std::min(kPanelCols, N - p * kPanelCols);
    const int64_t per_tile = (lines + (t1 - t0) - 1) / (t1 - t0);
    for (int64_t t = t0; t < t1; ++t) {
      const float* a = xr.rows(t, R);
      if (t1 - t0 == 1) {
        tile<true, R>(a, xr.stride(t), panel, K, c, stream, 0, last + 16);
      } else {  // this tile's share of the next panel, if the thread's run has one
        const float* pf = panel + panel_floats + (t - t0) * per_tile * 16;
        const int64_t share = p + 1 < limit && pf <= last ? std::min(per_tile, (last - pf) / 16 + 1) : 0;
        tile<false, R>(a, xr.stride(t), panel, K, c, pf, share, last);
      }
      for (int64_t m = 0; m < R && t * R + m < M; ++m)
        store_row(y + (t * R + m) * N + p * kPanelCols, c + m * kPanelCols, bias ? bias + p * kPanelCols : nullptr, cols);
    }
  }
}

// y = x . panels (+ bias) in x tiles of R rows: per block of x tiles, the panels shared out between the threads
// (shares.h), each thread starting on its own contiguous run.
template <int64_t R>
void gemm_rows(const at::Tensor& x, const at::Tensor& panels, const float* bias, int64_t n, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), T = (M + R - 1) / R;
  at::Tensor tail;
  const XRows xr = x_rows<R>(x, tail);
  const int64_t block = std::max<int64_t>(1, x_block_bytes() / (K * R * 4 + 1));  // tiles per x block
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  conveyor_shares::share_out(P, (T + block - 1) / block, [&](int64_t, int64_t b, int64_t p0, int64_t p1, int64_t limit) {
    panel_run<R>(xr, wp, K, M, n, bias, yp, b * block, std::min(T, (b + 1) * block), p0, p1, limit);
  });
}

// wide: tiles of kWideRows rows beyond kWideMaxRows rows too (the same on avx2, where kWideRows is kPanelRows)
at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                      int64_t n, bool wide) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "panel_gemm: float32 x [M, K], rows contiguous");
  TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(2) == kPanelCols,
              "panel_gemm: contiguous float32 panels [P, K, ", kPanelCols, "] from pack_panels, K matching x");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanelCols && n <= panels.size(0) * kPanelCols,
              "panel_gemm: n = ", n, " does not fit ", panels.size(0), " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                            "panel_gemm: contiguous float32 bias [n]");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  if (x.size(0) > kPanelRows && (wide || x.size(0) <= kWideMaxRows)) {
    gemm_rows<kWideRows>(x, panels, bp, n, y);
  } else {
    gemm_rows<kPanelRows>(x, panels, bp, n, y);
  }
  return y;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.impl("pack_panels", c10::DispatchKey::CPU, TORCH_FN(pack_panels));
  m.def("panel_gemm(Tensor x, Tensor panels, Tensor? bias, int n, bool wide=False) -> Tensor");
  m.impl("panel_gemm", c10::DispatchKey::CPU, TORCH_FN(panel_gemm));
}
