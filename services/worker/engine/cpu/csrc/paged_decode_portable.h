// Paged decode attention's operands and its portable path (any compiler, any head dim, K/V of any floating type):
// the last fallback of paged_decode.cpp, whose vector path computes the same, and the reference its tests hold the
// vector path to beside torch's. Included by paged_decode.cpp (one translation unit: kernels.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// The portable path: what the vector path (paged_decode.cpp) computes, written for any compiler and any D.
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

}  // namespace
