// y [M, N] = x [M, K] . w [N, K]^T (+ bias) in float32, for a weight each 32-value block of whose rows is exactly
// a code times a scale: Q4 fl(fl(d * q) + m), q 0..15 (a GGUF Q4_1 tensor converted to float32: the default
// SmolLM2's linears), or Q8 fl(d * q), q -127..127 (Q8_0: its embedding, the tied LM head); d and m numbers of the
// block (coded.py finds them and the codes, and checks every value). The weight is read as its codes (5 or 9 bits a
// value against float32's 32) and each float32 value rebuilt in L1, to the bit, before the same FMAs as the panel
// GEMM (csrc/panel_gemm.cpp) in the same order: the result is the panel GEMM's to the bit (the tests check it), and
// the model's numbers are float32's as ever. Registered as torch.ops.conveyor_<isa>.pack_q4 / pack_q8 / coded_gemm;
// gemm.py offers it to the GEMM plans as the `q4` and `q8` kernels, with their packed copies (gemm_kernels.COPIES).
//
// Why: a decode step at a few to a few dozen rows reads every weight once, from memory; at 32 rows on the Xeon of
// docs/benchmarks.md that read (425 MB of float32 for the layers) and the FMAs add up rather than overlap
// (benchmarks.overlap), so reading a sixth of the bytes takes most of the read's share off the step; at one row the
// step is the read.
//
// Layout (pack_q4, pack_q8): panels of kCols = 2 W output columns; per panel and block of 32 k-steps one record: d
// [kCols] (float32), Q4 also m [kCols], then 32 k-steps of codes: Q4 W bytes, byte j holding column j's code in its
// low nibble and column j + W's in its high one; Q8 kCols signed bytes. Each thread takes a contiguous run of panels;
// per panel and kBufRecords blocks it rebuilds their 32 x kCols floats each into an L1 buffer once, and every tile
// of R x rows runs its k-steps over that buffer, its accumulators carried in a per-thread scratch from pass to pass;
// an x block of one tile (up to 4 rows on avx2, 8 on avx512) rebuilds each k-step in registers beside its FMAs
// instead (lone_tile).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "shares.h"
#include "vec.h"

namespace {

constexpr int64_t kCodeBlock = 32;  // k-steps (values of a weight row) sharing one d (and m)
#if defined(CONVEYOR_VEC)
constexpr int64_t kCodeLanes = conveyor_vec::W;
#else
constexpr int64_t kCodeLanes = 8;
#endif
constexpr int64_t kCodeCols = 2 * kCodeLanes;  // columns of a panel: two vectors
// bytes of one record: Q4 d, m and 32 x W bytes; Q8 d and 32 x kCodeCols bytes
template <int kBits>
constexpr int64_t record_bytes() {
  return kBits == 4 ? 2 * kCodeCols * 4 + kCodeBlock * kCodeLanes : kCodeCols * 4 + kCodeBlock * kCodeCols;
}
// Tiles of x rows: two accumulators a row. kCodeMaxRows: the widest a lone tile (rebuilding in registers) leaves
// registers for; kCodeWideRows: the widest over the L1 buffer, taken from 9 rows (avx512: 8, the same).
// Why 6 rows on avx2 (12 accumulators + 2 weight vectors + 1 x of 16 registers), not 4: 4 rows keep 8 FMA chains
// in flight, exactly what 2 FMA pipes of 4 cycles' latency need, with no slack and a load for every FMA and a
// third; a standalone loop of these FMAs on L1-resident operands, 32 k-steps a call, on the Zen 3 of
// docs/benchmarks.md ran 107 GFLOPS on both cores at 4 rows against 141 at 6 (the panel GEMM's 4 x 24: 148). The
// zero rows a 6-row tiling pads (36 for 32) cost less than that: with kBufRecords below, the model's 121 weights at
// 9-64 rows 1.09-1.25x faster (benchmarks.gemv --baseline, one process).
#if defined(CONVEYOR_VEC) && CONVEYOR_VEC == 16
constexpr int64_t kCodeMaxRows = 8, kCodeWideRows = 8;
#elif defined(CONVEYOR_VEC)
constexpr int64_t kCodeMaxRows = 4, kCodeWideRows = 6;
#else
constexpr int64_t kCodeMaxRows = 4, kCodeWideRows = 4;
#endif
constexpr int64_t kCodeAheadRecords = 4;  // records prefetched ahead of the one being rebuilt
// Records rebuilt into the L1 buffer at once, before every tile's FMAs over them: each tile's accumulators are loaded
// and stored once a pass, so more k-steps a pass spend fewer of its loads and stores on them. 8 lanes (avx2, and the
// portable loop): 4 records, 8 KB, measured with the 6-row tiles on the Zen 3; avx512 keeps one, unmeasured there.
constexpr int64_t kBufRecords = kCodeLanes == 8 ? 4 : 1;

// codes [N, K] (Q4: uint8 0..15; Q8: int8), d (and m, Q4) [N, K / 32] float32 -> records [P, K / 32, bytes]
// (columns past N: zeros).
template <int kBits>
at::Tensor pack_codes(const at::Tensor& codes, const at::Tensor& d, const at::Tensor* m) {
  const auto want = kBits == 4 ? at::kByte : at::kChar;
  TORCH_CHECK(codes.scalar_type() == want && codes.dim() == 2 && codes.is_contiguous(), "pack_q", kBits, ": ",
              kBits == 4 ? "uint8" : "int8", " codes [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), KB = K / kCodeBlock, P = (N + kCodeCols - 1) / kCodeCols;
  TORCH_CHECK(K % kCodeBlock == 0 && K > 0, "pack_q", kBits, ": K = ", K, " is not a positive multiple of ", kCodeBlock);
  for (const at::Tensor* t : {&d, m})
    TORCH_CHECK(t == nullptr || (t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                                 t->size(0) == N && t->size(1) == KB),
                "pack_q", kBits, ": contiguous float32 scales [N, K / 32]");
  at::Tensor out = at::zeros({P, KB, record_bytes<kBits>()}, codes.options().dtype(at::kByte));
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float *dp = d.data_ptr<float>(), *mp = m ? m->data_ptr<float>() : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint8_t* rec = op + (p * KB + kb) * record_bytes<kBits>();
        float* rd = reinterpret_cast<float*>(rec);
        uint8_t* rq = rec + (kBits == 4 ? 2 : 1) * kCodeCols * 4;
        for (int64_t j = 0; j < kCodeCols && p * kCodeCols + j < N; ++j) {
          const int64_t n = p * kCodeCols + j;
          rd[j] = dp[n * KB + kb];
          if (kBits == 4) rd[kCodeCols + j] = mp[n * KB + kb];
          for (int64_t k = 0; k < kCodeBlock; ++k) {
            const uint8_t c = cp[n * K + kb * kCodeBlock + k];
            if (kBits == 8) {
              rq[k * kCodeCols + j] = c;
            } else {
              rq[k * kCodeLanes + j % kCodeLanes] |= j < kCodeLanes ? (c & 15) : static_cast<uint8_t>(c << 4);
            }
          }
        }
      }
  });
  return out;
}

at::Tensor pack_q4(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) { return pack_codes<4>(codes, d, &m); }
at::Tensor pack_q8(const at::Tensor& codes, const at::Tensor& d) { return pack_codes<8>(codes, d, nullptr); }

// k-step k of a record's block rebuilt into b0, b1 (its two vectors of columns): Q4 fl(fl(d * q) + m), the product
// never contracted with the sum into an FMA (that would round once and differ from the weight in its last bit); Q8
// fl(d * q). d, m: the record's scales (m unused for Q8).
#if defined(CONVEYOR_VEC)
template <int kBits>
inline void rebuild_step(const uint8_t* rq, int64_t k, const conveyor_vec::vf (&d)[2], const conveyor_vec::vf (&m)[2],
                         conveyor_vec::vf& b0, conveyor_vec::vf& b1) {
  using namespace conveyor_vec;
  if (kBits == 8) {
    b0 = vmul(vbytes(rq + k * kCodeCols), d[0]);
    b1 = vmul(vbytes(rq + k * kCodeCols + W), d[1]);
    return;
  }
  vf lo, hi;
  vnibbles(rq + k * W, lo, hi);
  vf p0 = vmul(lo, d[0]), p1 = vmul(hi, d[1]);
  asm("" : "+v"(p0), "+v"(p1));  // the products stay rounded on their own
  b0 = vadd(p0, m[0]);
  b1 = vadd(p1, m[1]);
}

// The record's scales: d, and m (Q4; Q8: d again, unused).
template <int kBits>
inline void record_scales(const uint8_t* rec, conveyor_vec::vf (&d)[2], conveyor_vec::vf (&m)[2]) {
  using namespace conveyor_vec;
  const float* rd = reinterpret_cast<const float*>(rec);
  const float* rm = kBits == 4 ? rd + kCodeCols : rd;
  d[0] = vload(rd), d[1] = vload(rd + W), m[0] = vload(rm), m[1] = vload(rm + W);
}
#endif

// buf [32, kCodeCols] = the record's block rebuilt (rebuild_step's values).
template <int kBits>
inline void rebuild(const uint8_t* rec, float* buf) {
  const uint8_t* rq = rec + (kBits == 4 ? 2 : 1) * kCodeCols * 4;
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  vf d[2], m[2];
  record_scales<kBits>(rec, d, m);
  for (int64_t k = 0; k < kCodeBlock; ++k) {
    vf b0, b1;
    rebuild_step<kBits>(rq, k, d, m, b0, b1);
    vstore(buf + k * kCodeCols, b0);
    vstore(buf + k * kCodeCols + W, b1);
  }
#else
  const float* rd = reinterpret_cast<const float*>(rec);
  for (int64_t k = 0; k < kCodeBlock; ++k)
    for (int64_t j = 0; j < kCodeCols; ++j) {
      if (kBits == 8) {
        buf[k * kCodeCols + j] = static_cast<float>(static_cast<int8_t>(rq[k * kCodeCols + j])) * rd[j];
        continue;
      }
      const uint8_t b = rq[k * kCodeLanes + j % kCodeLanes];
      volatile float prod = static_cast<float>(j < kCodeLanes ? b & 15 : b >> 4) * rd[j];
      buf[k * kCodeCols + j] = prod + rd[kCodeCols + j];
    }
#endif
}

// acc [R, kCodeCols] (+)= a [R rows of stride as, steps] . steps k-steps of weight, each k-step's two vectors from
// step(k, b0, b1); first: from zero. The panel GEMM's FMAs in its order.
#if defined(CONVEYOR_VEC)
template <int64_t R, typename Step>
inline void tile_fmas(const float* a, int64_t as, float* acc, bool first, int64_t steps, Step step) {
  using namespace conveyor_vec;
  vf c[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) c[r][v] = first ? vzero() : vload(acc + r * kCodeCols + v * W);
  for (int64_t k = 0; k < steps; ++k) {
    vf b0, b1;
    step(k, b0, b1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xv = vset1(a[r * as + k]);
      c[r][0] = vfmadd(xv, b0, c[r][0]);
      c[r][1] = vfmadd(xv, b1, c[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) vstore(acc + r * kCodeCols + v * W, c[r][v]);
}
#endif

// acc [R, kCodeCols] (+)= a [R rows of stride as, steps] . buf [steps, kCodeCols] (blocks rebuilt); first: from zero.
template <int64_t R>
inline void coded_tile(const float* a, int64_t as, const float* buf, float* acc, bool first, int64_t steps) {
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  tile_fmas<R>(a, as, acc, first, steps, [buf](int64_t k, vf& b0, vf& b1) {
    b0 = vload(buf + k * kCodeCols), b1 = vload(buf + k * kCodeCols + W);
  });
#else
  for (int64_t i = 0; first && i < R * kCodeCols; ++i) acc[i] = 0.f;
  for (int64_t k = 0; k < steps; ++k)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < kCodeCols; ++j) acc[r * kCodeCols + j] += a[r * as + k] * buf[k * kCodeCols + j];
#endif
}

// coded_tile for an x block of one tile (M <= kCodeMaxRows: 4 on avx2, 8 on avx512): each k-step's weight rebuilt
// in registers just before its FMAs, not the whole block into buf first. The FMAs and their order are coded_tile's
// (the result is the same to the bit); what changes is that the rebuild of the next k-steps overlaps the FMA chains:
// with the block rebuilt first, a 1-row tile's two chains (an FMA's latency each k-step) ran after the rebuild, not
// beside it. On the Zen 3 of docs/benchmarks.md (avx2: 8 lanes, twice avx512's rebuilds per weight), side by side
// in one process (benchmarks.gemv --baseline, three runs): the model's 121 weights at 1 row in 7.6-9.5 ms against
// 10.0-12.4, at 2 rows 8.8-12.1 against 10.9-16.5, at 4 rows 10.8-14.6 against 11.7-18.4.
template <int kBits, int64_t R>
inline void lone_tile(const uint8_t* rec, const float* a, int64_t as, float* acc, bool first, float* buf) {
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  (void)buf;
  const uint8_t* rq = rec + (kBits == 4 ? 2 : 1) * kCodeCols * 4;
  vf d[2], m[2];
  record_scales<kBits>(rec, d, m);
  tile_fmas<R>(a, as, acc, first, kCodeBlock, [&](int64_t k, vf& b0, vf& b1) { rebuild_step<kBits>(rq, k, d, m, b0, b1); });
#else
  rebuild<kBits>(rec, buf);
  coded_tile<R>(a, as, buf, acc, first, kCodeBlock);
#endif
}

// Panels [p0, p1) against x tiles [t0, t1) of R rows (panel_gemm's XRows), into y (+ bias).
template <int kBits, int64_t R>
void coded_run(const XRows& xr, const uint8_t* recs, int64_t K, int64_t M, int64_t N, const float* bias, float* y,
               int64_t t0, int64_t t1, int64_t p0, int64_t p1, float* acc) {
  alignas(64) float buf[kBufRecords * kCodeBlock * kCodeCols];
  const int64_t KB = K / kCodeBlock, bytes = record_bytes<kBits>();
  const bool lone = R <= kCodeMaxRows && t1 - t0 == 1;  // a wider tile has no registers to rebuild in
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t kb = 0, n = 0; kb < KB; kb += n) {
      n = lone ? 1 : std::min(kBufRecords, KB - kb);  // records this pass
      const uint8_t* rec = recs + (p * KB + kb) * bytes;
      for (int64_t b = 0; b < n * bytes; b += 64) __builtin_prefetch(rec + kCodeAheadRecords * bytes + b);
      if (lone) {
        lone_tile<kBits, std::min(R, kCodeMaxRows)>(rec, xr.rows(t0, R) + kb * kCodeBlock, xr.stride(t0), acc, kb == 0,
                                                    buf);
        continue;
      }
      for (int64_t r = 0; r < n; ++r) rebuild<kBits>(rec + r * bytes, buf + r * kCodeBlock * kCodeCols);
      for (int64_t t = t0; t < t1; ++t)
        coded_tile<R>(xr.rows(t, R) + kb * kCodeBlock, xr.stride(t), buf, acc + (t - t0) * R * kCodeCols, kb == 0,
                      n * kCodeBlock);
    }
    const int64_t cols = std::min(kCodeCols, N - p * kCodeCols);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < R && t * R + r < M; ++r)
        store_row(y + (t * R + r) * N + p * kCodeCols, acc + ((t - t0) * R + r) * kCodeCols,
                  bias ? bias + p * kCodeCols : nullptr, cols);  // panel_gemm's (its vector path: 48 columns)
  }
}

template <int kBits, int64_t R>
void coded_rows(const at::Tensor& x, const at::Tensor& recs, const float* bias, int64_t n, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = recs.size(0), T = (M + R - 1) / R;
  at::Tensor tail;
  const XRows xr = x_rows<R>(x, tail);
  const int64_t block = std::max<int64_t>(1, x_block_bytes() / (K * R * 4));  // tiles per x block (panel_gemm's)
  const uint8_t* rp = recs.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t per_acc = std::min(block, T) * R * kCodeCols;  // a thread's sums of one block's tiles
  // ATen's allocator aligns to 64 bytes and per_acc is a multiple of 16 floats (kCodeCols is): no cache line holds
  // two threads' sums (std::vector's 16-byte alignment let one line straddle them, written by both every record)
  at::Tensor acc_t = at::empty({std::min<int64_t>(conveyor_shares::kernel_threads(), P) * per_acc}, x.options());
  float* const acc = acc_t.data_ptr<float>();
  conveyor_shares::share_out(P, (T + block - 1) / block, [&](int64_t j, int64_t b, int64_t p0, int64_t p1, int64_t) {
    coded_run<kBits, R>(xr, rp, K, M, n, bias, yp, b * block, std::min(T, (b + 1) * block), p0, p1,
                        acc + j * per_acc);
  });
}

template <int kBits>
void coded_by_rows(const at::Tensor& x, const at::Tensor& recs, const float* bias, int64_t n, at::Tensor& y) {
  const int64_t M = x.size(0);
  if (M == 1) {
    coded_rows<kBits, 1>(x, recs, bias, n, y);
  } else if (M == 2) {
    coded_rows<kBits, 2>(x, recs, bias, n, y);
  } else if (M <= 4) {
    coded_rows<kBits, 4>(x, recs, bias, n, y);
  } else if (M <= 8) {
    coded_rows<kBits, kCodeMaxRows>(x, recs, bias, n, y);
  } else {
    coded_rows<kBits, kCodeWideRows>(x, recs, bias, n, y);
  }
}

// bits: 4 (pack_q4's records) or 8 (pack_q8's)
at::Tensor coded_gemm(const at::Tensor& x, const at::Tensor& recs, const c10::optional<at::Tensor>& bias, int64_t n,
                      int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "coded_gemm: bits = ", bits, ", not 4 or 8");
  const int64_t bytes = bits == 4 ? record_bytes<4>() : record_bytes<8>();
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "coded_gemm: float32 x [M, K], rows contiguous");
  TORCH_CHECK(recs.scalar_type() == at::kByte && recs.dim() == 3 && recs.is_contiguous() &&
                  recs.size(1) * kCodeBlock == x.size(1) && recs.size(2) == bytes,
              "coded_gemm: contiguous records [P, K / 32, ", bytes, "] from pack_q", bits, ", K matching x");
  TORCH_CHECK(n > (recs.size(0) - 1) * kCodeCols && n <= recs.size(0) * kCodeCols, "coded_gemm: n = ", n,
              " does not fit ", recs.size(0), " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                            "coded_gemm: contiguous float32 bias [n]");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  if (bits == 4) {
    coded_by_rows<4>(x, recs, bp, n, y);
  } else {
    coded_by_rows<8>(x, recs, bp, n, y);
  }
  return y;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("pack_q4(Tensor codes, Tensor d, Tensor m) -> Tensor");
  m.impl("pack_q4", c10::DispatchKey::CPU, TORCH_FN(pack_q4));
  m.def("pack_q8(Tensor codes, Tensor d) -> Tensor");
  m.impl("pack_q8", c10::DispatchKey::CPU, TORCH_FN(pack_q8));
  m.def("coded_gemm(Tensor x, Tensor records, Tensor? bias, int n, int bits) -> Tensor");
  m.impl("coded_gemm", c10::DispatchKey::CPU, TORCH_FN(coded_gemm));
}
