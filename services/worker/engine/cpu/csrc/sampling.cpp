// Inverse-CDF sampling of one token per row from softmax(x * inv_temp), given one uniform per row.
// Registered as torch.ops.conveyor_<isa>.sample_rows (built per ISA and loaded by cpu_ops.py; vec.h).
//
// Why: in torch the same draw is a division, a softmax, a cumsum and a searchsorted, each a pass over the
// [rows, vocabulary] logits with its own output (~6 ms for 32 rows of 49,152 on the 2-core VM, 5 % of a
// serving step). Here it is two passes and no allocation: one for the row's max, one for exp and the sums of
// 16-value chunks; the chunk sums are then walked to the uniform's share of the total and only the chunk it
// falls in is re-expanded. The total is the sum of those same chunk sums in the same order, so the walk
// always ends inside the row, on a token whose probability is not zero.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kChunk = 16;

constexpr uint32_t kNegInfBits = 0xFF800000u;

// By its bits: the build's -ffast-math lets the compiler assume no value is infinite, so x == -INFINITY
// could be folded to false; masked tokens (top-k/top-p/min-p filters) are exactly -inf.
inline bool is_neg_inf(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b == kNegInfBits;
}

// e[i] = exp((x[i] - mx) * it) for one chunk of n <= 16 values, exactly 0 where x is -inf; returns their sum.
inline float chunk_exp(const float* x, int64_t n, float mx, float it, float* e) {
#if defined(CONVEYOR_VEC)
  using namespace conveyor_vec;
  vf sum = vzero();
  for (int64_t j = 0; j < kChunk; j += W) {  // one avx512 vector, two avx2 ones
    const vmask k = vfirst(n - j);
    const vf v = vload_first(x + j, k);
    const vf r = vkeep(vexp(vmul(vsub(v, vset1(mx)), vset1(it))), vnot_neg_inf(v, k));
    vstore(e + j, r);
    sum = vadd(sum, r);
  }
  return vreduce_add(sum);
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    e[i] = is_neg_inf(x[i]) ? 0.f : std::exp((x[i] - mx) * it);
    s += e[i];
  }
  return s;
#endif
}

int64_t draw_row(const float* x, int64_t V, float it, float u, std::vector<float>& sums) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[i]);
  if (is_neg_inf(mx)) return 0;  // nothing allowed: the caller's filters made sure
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  sums.resize(chunks);
  float e[kChunk];
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = chunk_exp(x + c * kChunk, std::min(kChunk, V - c * kChunk), mx, it, e);
    total += sums[c];
  }
  const float target = u * total;
  float cum = 0.f;
  int64_t c = 0;
  for (; c < chunks - 1 && cum + sums[c] <= target; ++c) cum += sums[c];
  while (c > 0 && sums[c] == 0.f) --c;  // the float edge (cum + sums[c] rounding to <= target at the end)
  const int64_t n = std::min(kChunk, V - c * kChunk);
  chunk_exp(x + c * kChunk, n, mx, it, e);
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] <= 0.f) continue;
    last = i;
    cum += e[i];
    if (cum > target) return c * kChunk + i;
  }
  return c * kChunk + last;  // rounding within the chunk: its last token with weight
}

// x [N, V] float32 (rows contiguous), inv_temp [N], u [N] in [0, 1) -> tokens [N] int64
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& u) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "sample_rows: float32 [N, V]");
  const int64_t N = x.size(0), V = x.size(1);
  auto it = inv_temp.to(at::kFloat).contiguous();
  auto uu = u.to(at::kFloat).contiguous();
  TORCH_CHECK(it.numel() == N && uu.numel() == N, "sample_rows: one temperature and one uniform per row");
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  const float* x_p = x.data_ptr<float>();
  const float* it_p = it.data_ptr<float>();
  const float* u_p = uu.data_ptr<float>();
  int64_t* o_p = out.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t r = begin; r < end; ++r) o_p[r] = draw_row(x_p + r * ld, V, it_p[r], u_p[r], sums);
  });
  return out;
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("sample_rows(Tensor x, Tensor inv_temp, Tensor u) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
