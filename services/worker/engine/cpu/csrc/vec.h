// Vector helpers shared by the engine's CPU kernels: one small vocabulary (vf, vload, vfmadd, vexp, ...) over
// the ISA this translation unit is compiled for, so each kernel's vector path is written once.
//
// Which ISA: cpu_ops.py builds every source once per variant with explicit flags (no -march=native, so what
// is built is named and testable) and loads the best one the running CPU has:
//   avx512   (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c): W = 16 lanes, __m512, mask registers
//   avx2     (-mavx2 -mfma -mf16c, e.g. AMD Zen 3): W = 8 lanes, __m256, masks as lane vectors
//   portable (no vector flags): CONVEYOR_VEC undefined, each kernel's scalar loop runs
// CONVEYOR_VEC is W when a vector path exists. The ops namespace (CONVEYOR_NS, set by the build) differs per
// variant, so that several variants can be loaded in one process (the tests compare each with torch).
#pragma once

#if defined(__AVX512F__)
#define CONVEYOR_VEC 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONVEYOR_VEC 8
#endif

#ifndef CONVEYOR_NS
#define CONVEYOR_NS conveyor
#endif
// One level of indirection: TORCH_LIBRARY pastes its argument unexpanded, this expands CONVEYOR_NS first.
#define CONVEYOR_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define CONVEYOR_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

#if defined(CONVEYOR_VEC)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

namespace conveyor_vec {

constexpr int W = CONVEYOR_VEC;

// exp(x), x clamped to [-87, 88] (float32's normal range): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
// then a degree-7 Taylor polynomial (error ~5e-9 relative, under float32's rounding) and a scale by 2^n.
// Why not libm: the compiler calls expf once per value; this is one vector of W. The constants are shared by
// both widths so that avx2 and avx512 agree to the last bit on the polynomial.
#define CONVEYOR_EXP_BODY(P, ROUND, FNMADD, FMADD, MUL, MIN, MAX, SET1)                                      \
  x = MIN(MAX(x, SET1(-87.0f)), SET1(88.0f));                                                                \
  const P n = ROUND(MUL(x, SET1(1.4426950408889634f)));                                                      \
  P r = FNMADD(n, SET1(0.693145751953125f), x);                                                              \
  r = FNMADD(n, SET1(1.428606765330187e-06f), r);                                                            \
  P p = SET1(1.f / 5040);                                                                                    \
  p = FMADD(p, r, SET1(1.f / 720));                                                                          \
  p = FMADD(p, r, SET1(1.f / 120));                                                                          \
  p = FMADD(p, r, SET1(1.f / 24));                                                                           \
  p = FMADD(p, r, SET1(1.f / 6));                                                                            \
  p = FMADD(p, r, SET1(0.5f));                                                                               \
  p = FMADD(p, r, SET1(1.f));                                                                                \
  p = FMADD(p, r, SET1(1.f));

#if CONVEYOR_VEC == 16
using vf = __m512;
using vmask = __mmask16;

inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {  // bfloat16 -> float32: the 16 bits become the high half
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline vf vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// W bytes -> their low and high nibbles as floats (lo lane j: byte j & 15, hi lane j: byte j >> 4)
inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
// W signed bytes -> floats
inline vf vbytes(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }

// The first n lanes (n clamped to [0, W]).
inline vmask vfirst(int64_t n) { return n >= W ? vmask(0xFFFF) : n <= 0 ? vmask(0) : vmask((1u << n) - 1); }
// The lanes i with lo <= i < hi (either may lie outside [0, W]).
inline vmask vrange(int64_t lo, int64_t hi) { return static_cast<vmask>(vfirst(hi) & ~vfirst(lo)); }
// Whether every lane of a equals b's.
inline bool vall_equal(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ) == 0; }
inline vf vload_first(const float* p, vmask k) { return _mm512_maskz_loadu_ps(k, p); }
inline vf vload_first(const float* p, vmask k, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), k, p); }
inline void vstore_first(float* p, vmask k, vf v) { _mm512_mask_storeu_ps(p, k, v); }
inline vf vkeep(vf v, vmask k) { return _mm512_maskz_mov_ps(k, v); }
// The lanes of k whose value is not exactly -inf (by its bits: -ffast-math may assume no infinities).
inline vmask vnot_neg_inf(vf v, vmask k) {
  return _mm512_mask_cmpneq_epi32_mask(k, _mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0xFF800000u)));
}

inline vf vexp(vf x) {
#define CONVEYOR_ROUND512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
  CONVEYOR_EXP_BODY(__m512, CONVEYOR_ROUND512, _mm512_fnmadd_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_min_ps,
                    _mm512_max_ps, _mm512_set1_ps)
#undef CONVEYOR_ROUND512
  return _mm512_scalef_ps(p, n);
}

// r[i] = sum of v[i]'s 16 lanes, for i < 16: one transpose-add tree instead of 16 horizontal reductions.
inline vf vreduce_rows(const vf* v) {
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

#else  // CONVEYOR_VEC == 8: AVX2 + FMA + F16C
using vf = __m256;
using vmask = __m256i;  // all-ones lanes are in (AVX2 has no mask registers)

inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
inline vf vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {  // as avx512's
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline vf vbytes(const uint8_t* p) {  // as avx512's
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vreduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float vreduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

inline vmask vfirst(int64_t n) {
  const int c = static_cast<int>(n < 0 ? 0 : n > W ? W : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vmask vrange(int64_t lo, int64_t hi) { return _mm256_andnot_si256(vfirst(lo), vfirst(hi)); }
inline bool vall_equal(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_OQ)) == 0; }
// maskload touches only the lanes in k: a tail past the end of an allocation is never read.
inline vf vload_first(const float* p, vmask k) { return _mm256_maskload_ps(p, k); }
inline vf vload_first(const float* p, vmask k, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, k), _mm256_castsi256_ps(k));
}
inline void vstore_first(float* p, vmask k, vf v) { _mm256_maskstore_ps(p, k, v); }
inline vf vkeep(vf v, vmask k) { return _mm256_and_ps(v, _mm256_castsi256_ps(k)); }
inline vmask vnot_neg_inf(vf v, vmask k) {
  const __m256i inf = _mm256_cmpeq_epi32(_mm256_castps_si256(v), _mm256_set1_epi32(static_cast<int>(0xFF800000u)));
  return _mm256_andnot_si256(inf, k);
}

inline vf vexp(vf x) {
#define CONVEYOR_ROUND256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
  CONVEYOR_EXP_BODY(__m256, CONVEYOR_ROUND256, _mm256_fnmadd_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_min_ps,
                    _mm256_max_ps, _mm256_set1_ps)
#undef CONVEYOR_ROUND256
  // 2^n by its bits (AVX2 has no scalef): n is in [-126, 127] after the clamp, a normal float's exponent
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// r[i] = sum of v[i]'s 8 lanes, for i < 8: three rounds of pairwise adds, then the two 128-bit halves.
inline vf vreduce_rows(const vf* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low | v0..v3 high], v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#undef CONVEYOR_EXP_BODY

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace conveyor_vec
#endif
