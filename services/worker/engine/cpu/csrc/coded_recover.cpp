// A float32 weight's blocks of 32 values as codes and scales, exactly, or an empty list where it is not such blocks:
// the search coded.py describes and implements in torch (its reference, which the tests hold this to), in one pass
// over the weight. Why here: torch's passes over a whole weight per candidate scale took 2.49 s of one thread for the
// default SmolLM2's weights (every engine's start, before each GEMM plan can be keyed by whether its weight is
// coded); this takes 0.54 s. Registered as torch.ops.conveyor_<isa>.recover_q4 / recover_q8.
//
// The numbers must be IEEE float32's, rounded as torch rounds them: the variant is built with -ffast-math, which
// would turn the division into a multiply by a reciprocal, drop the finiteness checks and contract the product and
// the sum of a Q4 value into one FMA (one rounding instead of the file's two). So this file is compiled without it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

constexpr int64_t kRecoverBlock = 32;               // coded.py's BLOCK
constexpr int kDSteps[] = {0, -1, 1, -2, 2};        // coded.py's _D_STEPS: float16 neighbours of the estimate of d
constexpr uint32_t kExponent = 0x7f800000u;         // all ones: inf or NaN

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline bool finite(float v) { return (bits_of(v) & kExponent) != kExponent; }

inline float from_bits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// float32 -> the nearest float16's bits, ties to even (torch's .half()); written out rather than taken from torch's
// headers, whose software path relies on float rounding that -ffast-math may rewrite.
inline uint16_t half_bits(float f) {
  const uint32_t x = bits_of(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= kExponent) return static_cast<uint16_t>(sign | (ax > kExponent ? 0x7e00u : 0x7c00u));  // NaN, inf
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65,520 and up round to inf
  if (ax < 0x38800000u)  // below float16's smallest normal, 2^-14: a multiple of 2^-24 (exact scaling)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(__builtin_roundevenf(from_bits(ax) * 16777216.f)));
  uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));  // exponent rebiased 127 -> 15
  const uint32_t rest = ax & 0x1fffu;
  h += rest > 0x1000u || (rest == 0x1000u && (h & 1u));  // a carry into the exponent is the next binade (or inf)
  return static_cast<uint16_t>(sign | h);
}

inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return from_bits(sign | kExponent | (m << 13));
  if (e == 0) return (sign ? -1.f : 1.f) * static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24
  return from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

// The float16 number `step` bit patterns from h, as float32; 0 where that is not finite or negative.
inline float candidate(uint16_t h, int step) {
  const float c = half_value(static_cast<uint16_t>(static_cast<int16_t>(h) + step));
  return finite(c) && c >= 0.f ? c : 0.f;
}

// One block b [32]: the first candidate d whose codes rebuild every value to the bit; writes codes, d and (Q4) m.
// Q4: q = round((b - m) / d) in 0..15, rebuilt fl(fl(d * q) + m); Q8: q = round(b / d) in -127..127, fl(d * q).
template <int kBits>
bool recover_block(const float* b, void* codes, float* d_out, float* m_out) {
  float lo = b[0], hi = b[0], amax = std::fabs(b[0]);
  for (int64_t k = 0; k < kRecoverBlock; ++k) {
    if (!finite(b[k])) return false;
    lo = b[k] < lo ? b[k] : lo;
    hi = b[k] > hi ? b[k] : hi;
    amax = std::fabs(b[k]) > amax ? std::fabs(b[k]) : amax;
  }
  const float m = kBits == 4 ? lo : 0.f;
  const float qmin = kBits == 4 ? 0.f : -127.f, qmax = kBits == 4 ? 15.f : 127.f;
  const uint16_t h = half_bits(kBits == 4 ? (hi - lo) / 15.f : amax / 127.f);
  float q[kRecoverBlock];
  for (const int step : kDSteps) {
    const float d = candidate(h, step), div = d > 0.f ? d : 1.f;
    uint32_t differ = 0;  // the whole block without an early exit, in floats: the loop vectorizes
    for (int64_t k = 0; k < kRecoverBlock; ++k) {
      const float base = kBits == 4 ? b[k] - m : b[k];
      float r = __builtin_roundevenf(base / div);  // torch.round's ties to even; inlined, unlike nearbyint
      r = (r < qmin ? qmin : (r > qmax ? qmax : r)) + 0.f;  // + 0: a rounded -0.0 is the code 0, as an integer
      q[k] = r;
      const float prod = d * r;  // rounded on its own (fp-contract off), as the file's converter did
      const float rebuilt = kBits == 4 ? prod + m : prod;
      differ |= bits_of(rebuilt) ^ bits_of(b[k]);  // to the bit: -0.0 is not 0.0
    }
    if (differ) continue;
    for (int64_t k = 0; k < kRecoverBlock; ++k) {
      if (kBits == 4) {
        static_cast<uint8_t*>(codes)[k] = static_cast<uint8_t>(q[k]);
      } else {
        static_cast<int8_t*>(codes)[k] = static_cast<int8_t>(q[k]);
      }
    }
    *d_out = d;
    if (kBits == 4) *m_out = m;
    return true;
  }
  return false;
}

// w [N, K] float32 -> [codes [N, K] (Q4 uint8, Q8 int8), d [N, K / 32] (, m [N, K / 32], Q4)], or [] where any block
// is not exactly such codes (or w is not a contiguous float32 [N, K] with K a multiple of 32).
template <int kBits>
std::vector<at::Tensor> recover_codes(const at::Tensor& w) {
  if (w.scalar_type() != at::kFloat || w.dim() != 2 || w.numel() == 0 || w.size(1) % kRecoverBlock ||
      !w.device().is_cpu())
    return {};
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), blocks = N * K / kRecoverBlock;
  at::Tensor codes = at::empty({N, K}, wc.options().dtype(kBits == 4 ? at::kByte : at::kChar));
  at::Tensor d = at::empty({N, K / kRecoverBlock}, wc.options());
  at::Tensor m = at::empty({kBits == 4 ? N : 0, K / kRecoverBlock}, wc.options());
  const float* wp = wc.data_ptr<float>();
  auto* cp = static_cast<uint8_t*>(codes.data_ptr());
  float *dp = d.data_ptr<float>(), *mp = kBits == 4 ? m.data_ptr<float>() : nullptr;
  std::atomic<bool> refused{false};
  at::parallel_for(0, blocks, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1 && !refused.load(std::memory_order_relaxed); ++i)
      if (!recover_block<kBits>(wp + i * kRecoverBlock, cp + i * kRecoverBlock, dp + i, mp ? mp + i : nullptr))
        refused.store(true, std::memory_order_relaxed);
  });
  if (refused.load()) return {};
  if (kBits == 4) return {codes, d, m};
  return {codes, d};
}

std::vector<at::Tensor> recover_q4(const at::Tensor& w) { return recover_codes<4>(w); }
std::vector<at::Tensor> recover_q8(const at::Tensor& w) { return recover_codes<8>(w); }

}  // namespace

#pragma GCC pop_options

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("recover_q4(Tensor w) -> Tensor[]");
  m.impl("recover_q4", c10::DispatchKey::CPU, TORCH_FN(recover_q4));
  m.def("recover_q8(Tensor w) -> Tensor[]");
  m.impl("recover_q8", c10::DispatchKey::CPU, TORCH_FN(recover_q8));
}
