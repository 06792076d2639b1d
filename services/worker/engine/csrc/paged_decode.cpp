// Paged decode attention for CPU: one query token per sequence attends over that sequence's cached
// K/V read in place from the paged pool, so no per-layer gather copy of K/V is made.
// Registered as torch.ops.conveyor.paged_decode (built and loaded by cpu_ops.py).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

// out/q [S, H, D]; key/value [num_slots, KVH, D] (one layer of the pool, slot = block * bs + offset);
// block_tables [S, MB]; context_lens [S] (keys 0..len-1 are visible, the last one is the query's own).
template <typename T>
void paged_decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                       double scale, int64_t window) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = key.size(1), G = H / KVH;
  const int64_t MB = block_tables.size(1);
  auto bt = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t* bt_p = bt.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const float* q_p = q.data_ptr<float>();
  const T* k_p = key.data_ptr<T>();
  const T* v_p = value.data_ptr<T>();
  float* o_p = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // One task per sequence: its tokens' K (then V) rows are read in pool order, all KV heads of a token
  // at once (KVH * D contiguous floats), which the hardware prefetcher follows; per-head tasks would
  // stride through the same lines.
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = len_p[s];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      if (n <= 0) continue;
      scores.resize(H * n);  // [H, n]
      const int64_t* table = bt_p + s * MB;
      const float* qs = q_p + s * H * D;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
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
        const int64_t pos = start + t;
        const T* v = v_p + (table[pos / block_size] * block_size + pos % block_size) * KVH * D;
        for (int64_t hq = 0; hq < H; ++hq) axpy(os + hq * D, v + (hq / G) * D, scores[hq * n + t], D);
      }
    }
  });
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
