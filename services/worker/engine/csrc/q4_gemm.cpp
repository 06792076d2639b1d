// y [M, N] = x [M, K] . w [N, K]^T (+ bias) in float32, for a weight every 32-value block of whose rows is
// exactly fl(fl(d * q) + m): d and m two numbers of the block, q a 4-bit code (0..15). A model converted from a
// GGUF file's Q4_1 tensors is such a weight (the default SmolLM2's linears, all 3.3 M blocks of them: q4.py finds d,
// m and the codes and checks every value). The weight is read as its codes (4 bits a value, plus d and m: 5 bits
// a value against float32's 32) and each float32 value rebuilt in L1, to the bit, before the same FMAs as the panel
// GEMM (csrc/panel_gemm.cpp) in the same order: the result is the panel GEMM's to the bit (the tests check it), and
// the model's numbers are float32's as ever. Registered as torch.ops.conveyor_<isa>.pack_q4 / q4_gemm; gemm.py
// offers it to the GEMM plans as the `q4` kernel, with its packed copy (gemm_kernels.COPIES).
//
// Why: a decode step at a few to a few dozen rows reads every weight once, from memory; at 32 rows on the Xeon of
// docs/benchmarks.md that read (425 MB of float32 for the layers) and the FMAs add up rather than overlap
// (benchmarks.overlap), so reading a sixth of the bytes takes the read's share off the step; at one row the step is
// the read.
//
// Layout (pack_q4): panels of kCols = 2 W output columns; per panel and block of 32 k-steps one record: d [kCols],
// m [kCols] (float32), then 32 k-steps of W bytes, byte j holding column j's code in its low nibble and column
// j + W's in its high one. Each thread takes a contiguous run of panels; per panel and block it rebuilds the 32 x
// kCols floats into an L1 buffer once, and every tile of R x rows runs its 32 k-steps over that buffer, its
// accumulators carried in a per-thread scratch from block to block.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kQ4Block = 32;  // k-steps (values of a weight row) sharing one d and one m
#if defined(CONVEYOR_VEC)
constexpr int64_t kQ4Lanes = conveyor_vec::W;
#else
constexpr int64_t kQ4Lanes = 8;
#endif
constexpr int64_t kQ4Cols = 2 * kQ4Lanes;  // columns of a panel: one byte of codes per lane pair
constexpr int64_t kQ4RecordBytes = 2 * kQ4Cols * 4 + kQ4Block * kQ4Lanes;
// Tiles of x rows: twice kQ4Cols / W accumulators a row; the widest that leaves registers for the weight and x.
#if defined(CONVEYOR_VEC) && CONVEYOR_VEC == 16
constexpr int64_t kQ4MaxRows = 8;
#else
constexpr int64_t kQ4MaxRows = 4;
#endif
constexpr int64_t kQ4AheadBytes = 4 * kQ4RecordBytes;  // records prefetched ahead of the one being rebuilt

// codes [N, K] uint8 (0..15), d and m [N, K / 32] float32 -> records [P, K / 32, kQ4RecordBytes] (columns past N:
// d = m = 0, codes 0).
at::Tensor pack_q4(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), "pack_q4: uint8 codes [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), KB = K / kQ4Block, P = (N + kQ4Cols - 1) / kQ4Cols;
  TORCH_CHECK(K % kQ4Block == 0 && K > 0, "pack_q4: K = ", K, " is not a positive multiple of ", kQ4Block);
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == KB,
                "pack_q4: contiguous float32 d and m [N, K / 32]");
  at::Tensor out = at::zeros({P, KB, kQ4RecordBytes}, codes.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint8_t* rec = op + (p * KB + kb) * kQ4RecordBytes;
        float* rd = reinterpret_cast<float*>(rec);
        uint8_t* rq = rec + 2 * kQ4Cols * 4;
        for (int64_t j = 0; j < kQ4Cols && p * kQ4Cols + j < N; ++j) {
          const int64_t n = p * kQ4Cols + j;
          rd[j] = dp[n * KB + kb];
          rd[kQ4Cols + j] = mp[n * KB + kb];
          for (int64_t k = 0; k < kQ4Block; ++k) {
            const uint8_t c = cp[n * K + kb * kQ4Block + k] & 15;
            rq[k * kQ4Lanes + j % kQ4Lanes] |= j < kQ4Lanes ? c : static_cast<uint8_t>(c << 4);
          }
        }
      }
  });
  return out;
}

// buf [32, kQ4Cols] = the record's block rebuilt: fl(fl(d * q) + m), never contracted into an FMA (that would
// round once and differ from the weight in its last bit).
inline void rebuild(const uint8_t* rec, float* buf) {
  const float* rd = reinterpret_cast<const float*>(rec);
  const uint8_t* rq = rec + 2 * kQ4Cols * 4;
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  const vf d0 = vload(rd), d1 = vload(rd + W), m0 = vload(rd + kQ4Cols), m1 = vload(rd + kQ4Cols + W);
  for (int64_t k = 0; k < kQ4Block; ++k) {
    vf lo, hi;
    vnibbles(rq + k * W, lo, hi);
    vf p0 = vmul(lo, d0), p1 = vmul(hi, d1);
    asm("" : "+v"(p0), "+v"(p1));  // the products stay rounded on their own
    vstore(buf + k * kQ4Cols, vadd(p0, m0));
    vstore(buf + k * kQ4Cols + W, vadd(p1, m1));
  }
#else
  for (int64_t k = 0; k < kQ4Block; ++k)
    for (int64_t j = 0; j < kQ4Cols; ++j) {
      const uint8_t b = rq[k * kQ4Lanes + j % kQ4Lanes];
      volatile float prod = static_cast<float>(j < kQ4Lanes ? b & 15 : b >> 4) * rd[j];
      buf[k * kQ4Cols + j] = prod + rd[kQ4Cols + j];
    }
#endif
}

// acc [R, kQ4Cols] (+)= a [32, R] . buf [32, kQ4Cols]; first: from zero. The panel GEMM's FMAs in its order.
template <int64_t R>
inline void q4_tile(const float* a, const float* buf, float* acc, bool first) {
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  vf c[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) c[r][v] = first ? vzero() : vload(acc + r * kQ4Cols + v * W);
  for (int64_t k = 0; k < kQ4Block; ++k) {
    const vf b0 = vload(buf + k * kQ4Cols), b1 = vload(buf + k * kQ4Cols + W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xv = vset1(a[k * R + r]);
      c[r][0] = vfmadd(xv, b0, c[r][0]);
      c[r][1] = vfmadd(xv, b1, c[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) vstore(acc + r * kQ4Cols + v * W, c[r][v]);
#else
  for (int64_t i = 0; first && i < R * kQ4Cols; ++i) acc[i] = 0.f;
  for (int64_t k = 0; k < kQ4Block; ++k)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < kQ4Cols; ++j) acc[r * kQ4Cols + j] += a[k * R + r] * buf[k * kQ4Cols + j];
#endif
}

// Panels [p0, p1) against x tiles [t0, t1) of R rows (tiles [T, K, R], panel_gemm's pack_rows), into y (+ bias).
template <int64_t R>
void q4_run(const float* tiles, const uint8_t* recs, int64_t K, int64_t M, int64_t N, const float* bias, float* y,
            int64_t t0, int64_t t1, int64_t p0, int64_t p1, float* acc) {
  alignas(64) float buf[kQ4Block * kQ4Cols];
  const int64_t KB = K / kQ4Block;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* rec = recs + (p * KB + kb) * kQ4RecordBytes;
      for (int64_t b = 0; b < kQ4RecordBytes; b += 64) __builtin_prefetch(rec + kQ4AheadBytes + b);
      rebuild(rec, buf);
      for (int64_t t = t0; t < t1; ++t)
        q4_tile<R>(tiles + t * K * R + kb * kQ4Block * R, buf, acc + (t - t0) * R * kQ4Cols, kb == 0);
    }
    const int64_t cols = std::min(kQ4Cols, N - p * kQ4Cols);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < R && t * R + r < M; ++r) {
        const float* c = acc + ((t - t0) * R + r) * kQ4Cols;
        float* out = y + (t * R + r) * N + p * kQ4Cols;
        for (int64_t j = 0; j < cols; ++j) out[j] = c[j] + (bias ? bias[p * kQ4Cols + j] : 0.f);
      }
  }
}

template <int64_t R>
void q4_rows(const at::Tensor& x, const at::Tensor& recs, const float* bias, int64_t n, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = recs.size(0), T = (M + R - 1) / R;
  at::Tensor tiles = at::empty({T, K, R}, x.options());
  pack_rows<R>(x.data_ptr<float>(), x.stride(0), M, K, tiles.data_ptr<float>());
  const int64_t block = std::max<int64_t>(1, x_block_bytes() / (K * R * 4));  // tiles per x block (panel_gemm's)
  const float* tp = tiles.data_ptr<float>();
  const uint8_t* rp = recs.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t per_thread = (P + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, P, per_thread, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(std::min(block, T) * R * kQ4Cols);
    for (int64_t t0 = 0; t0 < T; t0 += block)
      q4_run<R>(tp, rp, K, M, n, bias, yp, t0, std::min(T, t0 + block), p0, p1, acc.data());
  });
}

at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& recs, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "q4_gemm: float32 x [M, K], rows contiguous");
  TORCH_CHECK(recs.scalar_type() == at::kByte && recs.dim() == 3 && recs.is_contiguous() &&
                  recs.size(1) * kQ4Block == x.size(1) && recs.size(2) == kQ4RecordBytes,
              "q4_gemm: contiguous records [P, K / 32, ", kQ4RecordBytes, "] from pack_q4, K matching x");
  TORCH_CHECK(n > (recs.size(0) - 1) * kQ4Cols && n <= recs.size(0) * kQ4Cols, "q4_gemm: n = ", n, " does not fit ",
              recs.size(0), " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                            "q4_gemm: contiguous float32 bias [n]");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  const int64_t M = x.size(0);
  if (M == 1) {
    q4_rows<1>(x, recs, bp, n, y);
  } else if (M == 2) {
    q4_rows<2>(x, recs, bp, n, y);
  } else if (M <= 4 || kQ4MaxRows == 4) {
    q4_rows<4>(x, recs, bp, n, y);
  } else {
    q4_rows<kQ4MaxRows>(x, recs, bp, n, y);
  }
  return y;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("pack_q4(Tensor codes, Tensor d, Tensor m) -> Tensor");
  m.impl("pack_q4", c10::DispatchKey::CPU, TORCH_FN(pack_q4));
  m.def("q4_gemm(Tensor x, Tensor records, Tensor? bias, int n) -> Tensor");
  m.impl("q4_gemm", c10::DispatchKey::CPU, TORCH_FN(q4_gemm));
}
