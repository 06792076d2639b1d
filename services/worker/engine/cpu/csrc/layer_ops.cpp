// The small per-layer operations of a Llama-family decoder, fused: the residual add with the RMSNorm that
// follows it, rotary embedding in place, SiLU(gate) * up. Registered as torch.ops.conveyor_<isa>.* (built per
// ISA and loaded by cpu_ops.py with paged_decode.cpp). SiLU has an explicit vector path (vec.h's exp); the
// norm and the rotary are `omp simd` loops of adds and multiplies, which the compiler vectorises to each
// variant's ISA flags by itself (and to SSE2 for the portable one).
//
// Why: at a serving batch (tens of rows of 576 values) each of these is several torch ops of a few
// microseconds, mostly dispatch and a pass over memory each: ~20 ops a layer. The formulas are
// transformers' (float32 statistics, the same order of the residual adds), so greedy outputs stay the same.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace {

// rows of n floats per task: small batches stay on one thread (a task switch costs more than the work)
inline int64_t grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              ": float32 [rows, n] with contiguous rows");
}

// out = RMSNorm(residual += x) * weight, row by row; x undefined: out = RMSNorm(residual) * weight.
void add_rms_norm(at::Tensor out, at::Tensor residual, const c10::optional<at::Tensor>& x, const at::Tensor& weight,
                  double eps) {
  check_rows(out, "add_rms_norm out");
  check_rows(residual, "add_rms_norm residual");
  const bool add = x.has_value() && x->defined();
  if (add) check_rows(*x, "add_rms_norm x");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "add_rms_norm: float32 weight");
  const int64_t T = residual.size(0), N = residual.size(1);
  float* r_p = residual.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const float* x_p = add ? x->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  const int64_t rs = residual.stride(0), os = out.stride(0), xs = add ? x->stride(0) : 0;
  at::parallel_for(0, T, grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = r_p + t * rs;
      float* o = o_p + t * os;
      if (add) {
        const float* xr = x_p + t * xs;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) r[i] += xr[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) o[i] = w[i] * (r[i] * inv);
    }
  });
}

// qk [T, heads, D] (any row/head strides, contiguous D) rotated in place: x * cos + rotate_half(x) * sin,
// rotate_half(x) = (-x2, x1); cos/sin [T, D].
void rotary(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && qk.dim() == 3 && qk.stride(2) == 1, "rotary: float32 [T, heads, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  cos.numel() == qk.size(0) * qk.size(2) && sin.numel() == cos.numel(),
              "rotary: contiguous float32 cos/sin [T, D]");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t ts = qk.stride(0), hs = qk.stride(1);
  float* p = qk.data_ptr<float>();
  const float* c_p = cos.data_ptr<float>();
  const float* s_p = sin.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = c_p + t * D;
      const float* s = s_p + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* x = p + t * ts + h * hs;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// out [T, I] = SiLU(gate) * up, gate_up [T, 2I] = (gate | up).
void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  check_rows(out, "silu_mul out");
  check_rows(gate_up, "silu_mul gate_up");
  const int64_t T = out.size(0), I = out.size(1);
  TORCH_CHECK(gate_up.size(0) == T && gate_up.size(1) == 2 * I, "silu_mul: gate_up [T, 2I] for out [T, I]");
  const float* g_p = gate_up.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, T, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = g_p + t * gs;
      const float* u = g + I;
      float* o = o_p + t * os;
      int64_t i = 0;
#if defined(CONVEYOR_VEC)
      using namespace conveyor_vec;
      const vf one = vset1(1.f);
      for (; i + W <= I; i += W) {
        const vf x = vload(g + i);
        vstore(o + i, vmul(vdiv(x, vadd(one, vexp(vsub(vzero(), x)))), vload(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor? x, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
