// Paged decode attention for CPU: one query token per sequence attends over that sequence's cached
// K/V read in place from the paged pool, so no per-layer gather copy of K/V is made.
// Registered as torch.ops.conveyor_<isa>.paged_decode (built per ISA and loaded by cpu_ops.py; vec.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "paged_decode_portable.h"
#include "shares.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

#if defined(CONVEYOR_VEC)
// The vector path (D a multiple of W, the ISA's lanes: 16 avx512, 8 avx2; see vec.h). Why not the portable
// loop: there, each score is a 64-wide dot product ending in a horizontal reduction, and each exp a libm call;
// that made it instruction-bound at ~15 GFLOPS (a third of a batch-32 decode step on the 2-core VM). Here W
// tokens' partial sums are reduced together (one transpose-add tree for W scores), exp is a vector
// polynomial, and the output accumulates in registers. K/V stay where the pool has them (no layout change
// for the other paths).
using namespace conveyor_vec;

// Accumulator registers a V pass may hold: 24 of avx512's 32 vector registers, 12 of avx2's 16 (the rest for
// the V row, the broadcast weight and addresses); more would spill to the stack inside the inner loop.
constexpr int kAccRegs = W == 16 ? 24 : 12;

// scores[0..W) = scale * q . k_t for the W rows starting at rows[0] (offset: the KV head's columns); D = W * NC, a
// compile-time count so that every accumulator lives in a register. A tail tile's rows past the sequence's end are
// its last row again (the caller pads them so), so every lane computes, the loop has no branch, and the scores past
// the end repeat the last one: room for them is part of the scores' rows (their stride is padded to a whole tile).
// Why whole stores: AVX2's masked store (vmaskmovps) here and in the softmax cost ~18 % of the kernel's time with K/V
// in cache on the Zen 3 of docs/benchmarks.md (2026-12-06: 67 against 55 ns a token, one thread, no loads ahead).
template <typename T, int NC>
inline void scores_tile(float* scores, const float* q, const T* const* rows, int64_t off, float sc) {
  vf acc[W];
  vf qc[NC];
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) qc[c] = vload(q + W * c);
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) {
    const T* k = rows[i] + off;
    acc[i] = vmul(qc[0], vload(k));
#pragma GCC unroll 16
    for (int c = 1; c < NC; ++c) acc[i] = vfmadd(qc[c], vload(k + W * c), acc[i]);
  }
  vstore(scores, vmul(vreduce_rows(acc), vset1(sc)));
}

// In place on scores_tile's row of n scores padded to a whole tile (the pad repeats the last score, so the max is
// the n scores' own): p = exp(s - max s), zero past n; returns 1 / sum p, and max s in `top`. Whole loads and
// stores, as scores_tile's.
inline float softmax_unnormalized(float* s, int64_t n, float& top) {
  vf mx = vset1(-INFINITY);
  for (int64_t t = 0; t < n; t += W) mx = vmax(mx, vload(s + t));
  top = vreduce_max(mx);
  const vf m = vset1(top);
  vf sum = vzero();
  for (int64_t t = 0; t < n; t += W) {
    vf e = vexp(vsub(vload(s + t), m));
    if (t + W > n) e = vkeep(e, vfirst(n - t));
    sum = vadd(sum, e);
    vstore(s + t, e);
  }
  return 1.f / vreduce_add(sum);
}

// How far ahead of the tile being computed the near loads run, in rows (KVH * D values each). Builds with 8, 16
// and 32 measured side by side on Zen 5 were within the VM's noise of each other (docs/benchmarks.md, "Decode
// attention that loads ahead"). The far loads run kFarRows further (48 KB of float32 rows at KVH * D = 192): 64,
// 112 and 176 measured alike on Zen 4, 2026-12-04.
constexpr int64_t kAheadRows = 16, kFarRows = 64;

// Loads rows ahead of the compute, a few cache lines at a time between the compute's own instructions, in two
// streams: one far ahead into L2, one just ahead into L1. A thread's rows are one list in the order it reads them
// (each sequence's K rows, then its V rows, then the next sequence's), so the loads run on across the end of one
// sequence into the next.
// Why at all: a tile's rows lie in one pool block, blocks lie anywhere, and the hardware prefetcher stops at each
// page boundary; why a few at a time: a tile's lines issued at once fill the core's miss buffers and stall the
// compute behind them. Why two streams: a core has few L1 miss buffers, too few lines in flight to cover DRAM's
// latency at the rate the kernel consumes rows; the L2 tracks more, so the far stream keeps memory busy and the
// near one then only moves lines from L2 to L1. On the Zen 4 VM of docs/benchmarks.md the near stream alone read
// 16-17 GB/s of K/V (batch 32, context 400, both cores), with the far one 24-27 GB/s of the machine's ~34.
// Why not the near stream on Intel: there each near load holds one of the core's L1 fill buffers until its line
// arrives, from memory when the far load has not brought it yet, and the far loads then wait for a buffer too. On
// the Xeon of docs/benchmarks.md (2026-12-05, benchmarks.decode_attention --baseline, one process, two runs) the far
// stream alone read 2-12 % more K/V than both in 23 of the 24 cases and block orders measured (3 % less in one).
inline bool near_stream() {
  static const bool near = !__builtin_cpu_is("intel");
  return near;
}

template <typename T>
struct Prefetcher {
  const T* const* rows;
  int64_t total, lines;  // rows, and the cache lines of one
  struct Cursor {
    int64_t row = 0, line = 0;  // the next line to load
  };
  Cursor near, far;

  // Load up to `count` more lines in each stream, none of a row at or past `until` (the far one: kFarRows further).
  void step(int64_t count, int64_t until) {
    advance<true>(far, count, until + kFarRows);
    if (near_stream()) advance<false>(near, count, until);
  }

  template <bool ToL2>
  void advance(Cursor& c, int64_t count, int64_t until) {
    until = std::min(until, total);
    while (count > 0 && c.row < until) {
      const char* r = reinterpret_cast<const char*>(rows[c.row]);
      const int64_t stop = std::min(lines, c.line + count);
      count -= stop - c.line;
      for (; c.line < stop; ++c.line) {
        if constexpr (ToL2) {
          prefetch_l2(r + 64 * c.line);
        } else {
          prefetch(r + 64 * c.line);
        }
      }
      if (c.line == lines) c.line = 0, ++c.row;
    }
  }
};

// o[h] += sum over the tile's m tokens of p[h][t] * v_t (the KV head's D = W * NC columns at off; p's rows n
// apart), for GC query heads of one KV head: each V row is loaded once for all of them. GC is a compile-time count so
// that the GC * NC accumulators live in registers and the inner loop has no branch (accumulate_heads picks it).
template <typename T, int NC, int GC>
inline void accumulate_tile(float* o, const float* p, int64_t n, const T* const* rows, int64_t off, int m) {
  vf acc[GC * NC];
#pragma GCC unroll 24
  for (int h = 0; h < GC; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[h * NC + c] = vload(o + h * W * NC + W * c);
  for (int i = 0; i < m; ++i) {
    const T* v = rows[i] + off;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const vf x = vload(v + W * c);
#pragma GCC unroll 24
      for (int h = 0; h < GC; ++h) acc[h * NC + c] = vfmadd(vset1(p[h * n + i]), x, acc[h * NC + c]);
    }
  }
#pragma GCC unroll 24
  for (int h = 0; h < GC; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) vstore(o + h * W * NC + W * c, acc[h * NC + c]);
}

// The query heads one pass over a tile's V rows can serve at head dim W * NC (their accumulators in registers).
template <int NC>
constexpr int kHeadsPerPass = kAccRegs / NC > 0 ? kAccRegs / NC : 1;

// accumulate_tile for gc <= GC heads, gc known only at run time: one compiled body per count.
template <typename T, int NC, int GC = kHeadsPerPass<NC>>
inline void accumulate_heads(float* o, const float* p, int64_t n, const T* const* rows, int64_t off, int m, int gc) {
  if constexpr (GC > 1) {
    if (gc < GC) return accumulate_heads<T, NC, GC - 1>(o, p, n, rows, off, m, gc);
  }
  accumulate_tile<T, NC, GC>(o, p, n, rows, off, m);
}

// One sequence, or a part of its tokens: os [H, D] = attention of qs [H, D] over n K/V rows, krows[0..n) and
// vrows = krows + padded (KVH * D values each; padded = n rounded up to a tile, the tail tile's rows repeated);
// `first` is krows' index in the prefetcher's list; for a part, each head's score max and softmax sum go to
// top[H] and sum[H] (merge_parts combines the parts). K, then V, in W-token tiles, every head of a tile before the
// next: a tile (part of one pool block) is read from memory once, in order, and stays in L1 while the heads reuse
// it.
template <typename T, int NC>
void attend_sequence(float* os, const float* qs, const T* const* krows, int64_t n, int64_t padded, int64_t first,
                     int64_t H, int64_t KVH, float sc, std::vector<float>& scores, Prefetcher<T>& pf,
                     float* top = nullptr, float* sum = nullptr) {
  constexpr int64_t D = W * NC;
  constexpr int kHeads = kHeadsPerPass<NC>;
  const int64_t G = H / KVH;
  const T* const* vrows = krows + padded;
  auto tile = [n](int64_t t) { return static_cast<int>(std::min<int64_t>(W, n - t)); };
  // A tile's lines spread over the calls that read it (H in the K pass, KVH in the V pass), plus a few so that
  // the loads catch up to their distance after a start.
  const int64_t k_lines = (W * pf.lines + H - 1) / H + 4, v_lines = (W * pf.lines + KVH - 1) / KVH + 4;
  scores.resize(H * padded);  // [H, padded]: each head's row a whole number of tiles (scores_tile stores tiles)
  for (int64_t t = 0; t < n; t += W) {
    for (int64_t hq = 0; hq < H; ++hq) {
      pf.step(k_lines, first + t + W + kAheadRows);
      scores_tile<T, NC>(scores.data() + hq * padded + t, qs + hq * D, krows + t, (hq / G) * D, sc);
    }
  }
  float inv[256], mx[256];
  for (int64_t hq = 0; hq < H; ++hq) inv[hq] = softmax_unnormalized(scores.data() + hq * padded, n, mx[hq]);
  if (top != nullptr)
    for (int64_t hq = 0; hq < H; ++hq) top[hq] = mx[hq], sum[hq] = 1.f / inv[hq];
  std::fill(os, os + H * D, 0.f);
  for (int64_t t = 0; t < n; t += W) {
    for (int64_t g = 0; g < KVH; ++g) {
      pf.step(v_lines, first + padded + t + W + kAheadRows);
      for (int64_t h = 0; h < G; h += kHeads)
        accumulate_heads<T, NC>(os + (g * G + h) * D, scores.data() + (g * G + h) * padded + t, padded, vrows + t,
                                g * D, tile(t), static_cast<int>(std::min<int64_t>(kHeads, G - h)));
    }
  }
  for (int64_t hq = 0; hq < H; ++hq) {
    const vf w = vset1(inv[hq]);
    for (int64_t c = 0; c < D; c += W) vstore(os + hq * D + c, vmul(vload(os + hq * D + c), w));
  }
}

// A thread's share of a call: parts of sequences, each a range [t0, t1) of its visible tokens; slot >= 0 when the
// part is not its whole sequence (its result then goes to a partial, merged afterwards).
struct Part {
  int64_t s, t0, t1, slot;
};

// What a sequence costs beyond its tokens (its block table walk, its softmax), in tokens; and the fewest tokens a
// part of a split sequence gets (below that, the thread's share is left a little over or under instead).
constexpr int64_t kSeqCost = 16, kMinPart = 4 * W;

// The call's sequences cut into `threads` runs of equal cost, in sequence order. Why not one task per sequence:
// a step's contexts differ (the oldest requests, first in a batch, are the longest; a conversation's turn sees its
// whole history), and a split by count left one core idle for up to a third of the call (16 x 300 + 16 x 100
// tokens: 14.6 GB/s against 20.7 interleaved); a single long sequence ran on one core. A sequence crossing a cut
// is split at a tile boundary into parts computed apart and merged (merge_parts), as flash-decoding does.
inline std::vector<std::vector<Part>> plan_parts(const int64_t* len_p, int64_t S, int64_t window, int64_t threads,
                                                 int64_t& slots) {
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) total += visible(len_p[s], window).n + kSeqCost;
  std::vector<std::vector<Part>> plan(threads);
  int64_t j = 0, pos = 0;  // the thread filled, and the cost handed out so far
  slots = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = visible(len_p[s], window).n;
    if (n <= 0) continue;
    for (int64_t t = 0; t < n;) {
      const int64_t cost = n - t + (t == 0 ? kSeqCost : 0), room = total * (j + 1) / threads - pos;
      int64_t take = n - t;
      if (j < threads - 1 && cost > room) {
        take = (room - (t == 0 ? kSeqCost : 0)) / W * W;
        if (take < kMinPart && t == 0) {  // hardly any of it fits: all of it to the next thread
          ++j;
          continue;
        }
        if (take < kMinPart || n - t - take < kMinPart) take = n - t;
      }
      const bool whole = t == 0 && take == n, cut = t + take < n;
      plan[j].push_back({s, t, t + take, whole ? -1 : slots++});
      pos += take + (t == 0 ? kSeqCost : 0);
      t += take;
      // a cut fills the thread's share (rounded down to a tile): the rest of the sequence is the next thread's
      if (j < threads - 1 && (cut || pos >= total * (j + 1) / threads)) ++j;
    }
  }
  return plan;
}

// A split sequence's result from its parts' (each normalized over its own tokens, with its score max and sum per
// head): weights sum_i * exp(max_i - max), the standard log-sum-exp merge.
inline void merge_parts(float* os, const float* po, const float* top, const float* sum, int64_t parts, int64_t H,
                        int64_t D) {
  for (int64_t h = 0; h < H; ++h) {
    float m = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, top[p * H + h]);
    float w[64], total = 0.f;
    for (int64_t p = 0; p < parts; ++p) total += (w[p] = sum[p * H + h] * std::exp(top[p * H + h] - m));
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t p = 0; p < parts; ++p) acc += w[p] * po[(p * H + h) * D + d];
      os[h * D + d] = acc / total;
    }
  }
}

template <typename T, int NC>
void paged_decode_vec(const Operands<T>& a) {
  const auto [S, H, D, KVH, MB, block_size, window, sc, q_p, k_p, v_p, o_p, bt_p, len_p] = a;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(conveyor_shares::kernel_threads(), 64));
  int64_t slots = 0;
  const auto plan = plan_parts(len_p, S, window, threads, slots);
  std::vector<float> po(slots * H * D), top(slots * H), sum(slots * H);  // the split sequences' parts
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      // The block table lookups, once for all heads: this thread's parts' K rows and V rows, each part's K
      // (padded to a whole tile with its last row: scores_tile) and then its V, in the order they are read.
      const auto& parts = plan[j];
      std::vector<const T*> rows;
      std::vector<int64_t> first(parts.size() + 1, 0);
      for (size_t i = 0; i < parts.size(); ++i) {
        const auto [s, t0, t1, slot] = parts[i];
        const int64_t start = visible(len_p[s], window).start, n = t1 - t0;
        const int64_t padded = (n + W - 1) / W * W, at = static_cast<int64_t>(rows.size());
        first[i] = at;
        rows.resize(at + 2 * padded);
        const int64_t* table = bt_p + s * MB;
        for (int64_t t = 0; t < padded; ++t) {
          const int64_t pos = start + t0 + std::min(t, n - 1);
          const int64_t at_slot = table[pos / block_size] * block_size + pos % block_size;
          rows[at + t] = k_p + at_slot * KVH * D;
          rows[at + padded + t] = v_p + at_slot * KVH * D;
        }
      }
      first[parts.size()] = static_cast<int64_t>(rows.size());
      Prefetcher<T> pf{rows.data(), static_cast<int64_t>(rows.size()),
                       (KVH * D * static_cast<int64_t>(sizeof(T)) + 63) / 64};
      std::vector<float> scores;
      for (size_t i = 0; i < parts.size(); ++i) {
        const auto [s, t0, t1, slot] = parts[i];
        const int64_t at = first[i], padded = (first[i + 1] - at) / 2;
        float* os = slot < 0 ? o_p + s * H * D : po.data() + slot * H * D;
        attend_sequence<T, NC>(os, q_p + s * H * D, rows.data() + at, t1 - t0, padded, at, H, KVH, sc, scores, pf,
                               slot < 0 ? nullptr : top.data() + slot * H, slot < 0 ? nullptr : sum.data() + slot * H);
      }
    }
  });
  // The split sequences: their parts hold consecutive slots, in token order.
  for (int64_t j = 0, done = -1; j < threads; ++j)
    for (const Part& p : plan[j]) {
      if (p.slot < 0 || p.s == done) continue;
      int64_t parts = 0;
      for (int64_t k = j; k < threads; ++k)
        for (const Part& q : plan[k]) parts += q.s == p.s;
      merge_parts(o_p + p.s * H * D, po.data() + p.slot * H * D, top.data() + p.slot * H, sum.data() + p.slot * H,
                  parts, H, D);
      done = p.s;
    }
}

// The head dims with a vector path: D = W * NC for these NC (avx512: 32..256, avx2: 16..128;
// Llama-family models use 64 or 128); true when run.
template <typename T>
bool paged_decode_vec_dispatch(const Operands<T>& ops) {
  if (ops.H > 256 || ops.D % W != 0) return false;  // (attend_sequence keeps H normalizers on its stack)
  switch (ops.D / W) {
    case 2: return paged_decode_vec<T, 2>(ops), true;
    case 4: return paged_decode_vec<T, 4>(ops), true;
    case 6: return paged_decode_vec<T, 6>(ops), true;
    case 8: return paged_decode_vec<T, 8>(ops), true;
    case 12: return paged_decode_vec<T, 12>(ops), true;
    case 16: return paged_decode_vec<T, 16>(ops), true;
    default: return false;
  }
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
#if defined(CONVEYOR_VEC)
  if constexpr (!std::is_same_v<T, double>) {  // a float64 pool (never the engine's) takes the portable path
    if (paged_decode_vec_dispatch<T>(ops)) return;
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

CONVEYOR_LIBRARY(CONVEYOR_NS, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor key, Tensor value, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int window) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
