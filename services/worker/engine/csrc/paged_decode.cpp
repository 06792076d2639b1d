// Paged decode attention for CPU: one query token per sequence attends over that sequence's cached
// K/V read in place from the paged pool, so no per-layer gather copy of K/V is made.
// Registered as torch.ops.conveyor.paged_decode (built and loaded by cpu_ops.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// K/V may be float32 or bfloat16/half (converted to float as read); q and the accumulators are float.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

template <typename T>
inline void axpy(float* y, const T* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

// The visible token range of a sequence and its K/V row pointers (pool order: block table lookups done once).
struct Span {
  int64_t start, n;
};

inline Span visible(int64_t len, int64_t window) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  return {start, len - start};
}

// One call's operands, read once: out/q [S, H, D]; key/value [num_slots, KVH, D] (one layer of the pool,
// slot = block * bs + offset); block_tables [S, MB]; context_lens [S] (keys 0..len-1 are visible, the last
// one is the query's own).
template <typename T>
struct Operands {
  int64_t S, H, D, KVH, MB, block_size, window;
  float sc;
  const float* q_p;
  const T *k_p, *v_p;
  float* o_p;
  const int64_t *bt_p, *len_p;
};

// The portable path: what the vector path below computes, written for any compiler and any D.
template <typename T>
void paged_decode_generic(const Operands<T>& a) {
  const auto [S, H, D, KVH, MB, block_size, window, sc, q_p, k_p, v_p, o_p, bt_p, len_p] = a;
  const int64_t G = H / KVH;
  // One task per sequence: its tokens' K (then V) rows are read in pool order, all KV heads of a token
  // at once (KVH * D contiguous values), which the hardware prefetcher follows.
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t s = begin; s < end; ++s) {
      const Span sp = visible(len_p[s], window);
      const int64_t n = sp.n;
      if (n <= 0) continue;
      scores.resize(H * n);  // [H, n]
      const int64_t* table = bt_p + s * MB;
      const float* qs = q_p + s * H * D;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = sp.start + t;
        const T* k = k_p + (table[pos / block_size] * block_size + pos % block_size) * KVH * D;
        for (int64_t hq = 0; hq < H; ++hq) scores[hq * n + t] = dot(qs + hq * D, k + (hq / G) * D, D) * sc;
      }
      for (int64_t hq = 0; hq < H; ++hq) {
        float* sg = scores.data() + hq * n;
        const float mx = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
      }
      float* os = o_p + s * H * D;
      std::fill(os, os + H * D, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = sp.start + t;
        const T* v = v_p + (table[pos / block_size] * block_size + pos % block_size) * KVH * D;
        for (int64_t hq = 0; hq < H; ++hq) axpy(os + hq * D, v + (hq / G) * D, scores[hq * n + t], D);
      }
    }
  });
}

#if defined(__AVX512F__)
// The vector path (D a multiple of 16). Why not the portable loop: there, each score is a 64-wide dot
// product ending in a horizontal reduction, and each exp a libm call; that made it instruction-bound at
// ~15 GFLOPS (a third of a batch-32 decode step on the 2-core VM). Here 16 tokens' partial sums are
// reduced together (one transpose-add tree for 16 scores), exp is a vector polynomial, and the output
// accumulates in registers. K/V stay where the pool has them (no layout change for the other paths).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 -> float32: the 16 bits become the high half
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i] = sum of v[i]'s 16 lanes, for i < 16.
inline __m512 reduce16(const __m512* v) {
  __m512 z[4];
  for (int g = 0; g < 4; ++g) {
    const __m512* a = v + 4 * g;
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of the pair (a, b)
    const __m512 x = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 y = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    // per lane: [A, B, C, D], each the lane's partial sum of a[0..3]
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    z[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)), _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
  }
  // sum each z's four lanes; z[g]'s sums land in lane g
  const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p, r, 0x88), _mm512_shuffle_f32x4(p, r, 0xDD));
}

// scores[t] = scale * q . k_t for the m <= 16 rows starting at rows[0] (offset: the KV head's columns);
// D = 16 * NC, a compile-time count so that every accumulator lives in a register.
template <typename T, int NC>
inline void scores16(float* scores, const float* q, const T* const* rows, int64_t off, int m, float sc) {
  __m512 acc[16];
  __m512 qc[NC];
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) qc[c] = _mm512_loadu_ps(q + 16 * c);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_setzero_ps();
    if (i < m) {
      const T* k = rows[i] + off;
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[i] = _mm512_fmadd_ps(qc[c], load16(k + 16 * c), acc[i]);
    }
  }
  const __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(sc));
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << m) - 1), r);
}

// In place: p = exp(s - max s); returns 1 / sum p.
inline float softmax_unnormalized(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, k, s + t));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = conveyor_vec::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), m));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(s + t, k, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Start loading the m rows at rows[0] (row_bytes each) into L1: the next tile's, while this one is computed.
// Why: a tile is one 16-slot block of the pool, blocks lie anywhere, and the hardware prefetcher stops
// at each page boundary.
template <typename T>
inline void prefetch_rows(const T* const* rows, int m, int64_t row_bytes) {
  for (int i = 0; i < m; ++i) {
    const char* r = reinterpret_cast<const char*>(rows[i]);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
  }
}

// o[h] += sum over the tile's m tokens of p[h][t] * v_t (the KV head's D = 16 * NC columns at off), for gc
// query heads of one KV head: each V row is loaded once for all of them. GMAX (compile time, with gc <= GMAX
// guarded) keeps the GMAX * NC accumulators in registers.
template <typename T, int NC, int GMAX = 24 / NC>
inline void accumulate_tile(float* o, const float* p, int64_t n, const T* const* rows, int64_t off, int m, int gc) {
  __m512 acc[GMAX * NC];
#pragma GCC unroll 24
  for (int h = 0; h < GMAX; ++h)
    if (h < gc)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[h * NC + c] = _mm512_loadu_ps(o + h * 16 * NC + 16 * c);
  for (int i = 0; i < m; ++i) {
    const T* v = rows[i] + off;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m512 x = load16(v + 16 * c);
#pragma GCC unroll 24
      for (int h = 0; h < GMAX; ++h)
        if (h < gc) acc[h * NC + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * n + i]), x, acc[h * NC + c]);
    }
  }
#pragma GCC unroll 24
  for (int h = 0; h < GMAX; ++h)
    if (h < gc)
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + h * 16 * NC + 16 * c, acc[h * NC + c]);
}

// One sequence: os [H, D] = attention of qs [H, D] over the n K/V rows krows/vrows (KVH * D values each).
// K, then V, in 16-token tiles, every head of a tile before the next: a tile (one pool block of 16 rows)
// is read from memory once, in order, and stays in L1 while the heads reuse it.
template <typename T, int NC>
void attend_sequence(float* os, const float* qs, const T* const* krows, const T* const* vrows, int64_t n, int64_t H,
                     int64_t KVH, float sc, std::vector<float>& scores) {
  constexpr int64_t D = 16 * NC;
  constexpr int kHeads = 24 / NC;  // query heads per pass over a tile's V rows (their accumulators in registers)
  const int64_t G = H / KVH, row_bytes = KVH * D * static_cast<int64_t>(sizeof(T));
  auto tile = [n](int64_t t) { return static_cast<int>(std::min<int64_t>(16, n - t)); };
  scores.resize(H * n);  // [H, n]
  for (int64_t t = 0; t < n; t += 16) {
    if (t + 16 < n) prefetch_rows(krows + t + 16, tile(t + 16), row_bytes);
    for (int64_t hq = 0; hq < H; ++hq)
      scores16<T, NC>(scores.data() + hq * n + t, qs + hq * D, krows + t, (hq / G) * D, tile(t), sc);
  }
  float inv[256];
  for (int64_t hq = 0; hq < H; ++hq) inv[hq] = softmax_unnormalized(scores.data() + hq * n, n);
  std::fill(os, os + H * D, 0.f);
  prefetch_rows(vrows, tile(0), row_bytes);
  for (int64_t t = 0; t < n; t += 16) {
    if (t + 16 < n) prefetch_rows(vrows + t + 16, tile(t + 16), row_bytes);
    for (int64_t g = 0; g < KVH; ++g)
      for (int64_t h = 0; h < G; h += kHeads)
        accumulate_tile<T, NC>(os + (g * G + h) * D, scores.data() + (g * G + h) * n + t, n, vrows + t, g * D,
                               tile(t), static_cast<int>(std::min<int64_t>(kHeads, G - h)));
  }
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m512 w = _mm512_set1_ps(inv[hq]);
    for (int64_t c = 0; c < D; c += 16)
      _mm512_storeu_ps(os + hq * D + c, _mm512_mul_ps(_mm512_loadu_ps(os + hq * D + c), w));
  }
}

template <typename T, int NC>
void paged_decode_avx512(const Operands<T>& a) {
  const auto [S, H, D, KVH, MB, block_size, window, sc, q_p, k_p, v_p, o_p, bt_p, len_p] = a;
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> krows, vrows;
    for (int64_t s = begin; s < end; ++s) {
      const Span sp = visible(len_p[s], window);
      if (sp.n <= 0) continue;
      const int64_t* table = bt_p + s * MB;
      krows.resize(sp.n);
      vrows.resize(sp.n);
      for (int64_t t = 0; t < sp.n; ++t) {  // the block table lookups, once for all heads
        const int64_t pos = sp.start + t;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        krows[t] = k_p + slot * KVH * D;
        vrows[t] = v_p + slot * KVH * D;
      }
      attend_sequence<T, NC>(o_p + s * H * D, q_p + s * H * D, krows.data(), vrows.data(), sp.n, H, KVH, sc, scores);
    }
  });
}
#endif

template <typename T>
void paged_decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                       double scale, int64_t window) {
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const Operands<T> ops{q.size(0), q.size(1), q.size(2), key.size(1), bt.size(1), block_size, window,
                        static_cast<float>(scale), q.data_ptr<float>(), key.data_ptr<T>(), value.data_ptr<T>(),
                        out.data_ptr<float>(), bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>()};
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {  // a float64 pool (never the engine's) takes the portable path
    if (ops.H <= 256) {  // (attend_sequence keeps H normalizers on its stack); other head dims: portable path
      if (ops.D == 64) return paged_decode_avx512<T, 4>(ops);
      if (ops.D == 128) return paged_decode_avx512<T, 8>(ops);
      if (ops.D == 32) return paged_decode_avx512<T, 2>(ops);
      if (ops.D == 96) return paged_decode_avx512<T, 6>(ops);
    }
  }
#endif
  paged_decode_generic<T>(ops);
}

// out/q float32 [S, H, D] (q converted by the caller); key/value float32, bfloat16 or float16.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                  double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "paged_decode: float32 q and out");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "paged_decode: key and value of one dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key.is_contiguous() && value.is_contiguous(),
              "paged_decode: contiguous tensors only");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(out, q, key, value, block_tables, context_lens, block_size, scale, window);
  });
}

}  // namespace

TORCH_LIBRARY(conveyor, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor key, Tensor value, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int window) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
