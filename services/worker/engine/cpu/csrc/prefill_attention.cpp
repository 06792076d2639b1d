// Paged prefill attention for CPU: the query rows of prefill chunks (and of drafted decode rows) attend to their
// sequence's keys, causally, read in place from the paged pool: one kernel whether a chunk starts at position 0
// or continues a cached context, no gather copy, no mask tensor, no merge of two passes.
// Registered as torch.ops.conveyor_<isa>.prefill_attention (built per ISA and loaded by cpu_ops.py; vec.h).
//
// Why not torch's CPU flash kernel: at head dim 64 it ran the products at ~60-150 GFLOPS on the 2-core VMs
// (docs/benchmarks.md), against the ~400 oneDNN reaches on the same machine's GEMMs, and it repeats every KV
// head's K/V per query head. Here a work item is one sequence, one KV head and a tile of positions: the tile's
// G query heads x positions are one set of query columns (GQA without copies), and both products are
// register-tiled GEMMs with the query columns in the vector lanes:
//   S^T [keys x queries]   = K [keys x D] . Q^T [D x queries]       (K's rows broadcast from the pool)
//   O^T [D x queries]     += V^T [D x keys] . P^T [keys x queries]  (V's values broadcast from the pool)
// so the online softmax (max, exp, sum per query) runs down the key rows with W queries per vector, and neither
// K nor V is ever transposed or packed (a float pool is read where it lies; a 16-bit one is widened per block).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "shares.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kKeyBlock = 64;   // keys per online-softmax step (S^T's rows)
constexpr int64_t kTileCols = 64;   // query columns a work item aims at (G heads x positions): 64 rather than
                                    // 128, Q^T, S^T and O^T of a tile (16 KB each) stay in L1 (+4-10 % GFLOPS on
                                    // the Xeon of docs/benchmarks.md)
constexpr float kMasked = -1e30f;   // a masked score: finite, so no inf - inf under -ffast-math

// One call's operands: q/out [N, H, D] (the sequences' rows packed in order); key/value [slots, KVH, D];
// block_tables [S, MB]; spans [S, 2] = (start, len): sequence s's len query rows are positions start.., and its
// keys 0 .. start + len - 1 are in the pool (the chunk's own written first).
template <typename T>
struct Prefill {
  int64_t H, D, KVH, MB, block_size, window;
  float sc;
  const float* q;
  float* out;
  const T *k, *v;
  const int64_t *tables, *spans, *row0;
};

// One work item: a sequence's KV head and its positions [t0, t1) of the chunk.
struct Item {
  int64_t seq, kvh, t0, t1, cost;
};

// A work item's scratch, reused across the items one thread takes.
struct Scratch {
  std::vector<float> qt, ot, st, m, l, kbuf, vbuf;
  std::vector<const float*> krows, vrows;
};

// Keys visible to a query at position p: lo(p) <= j <= p.
inline int64_t first_key(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

// The block's K/V rows as float pointers: into the pool for a float pool, else widened into the scratch.
template <typename T>
void block_rows(const Prefill<T>& a, const Item& it, int64_t j0, int64_t nk, Scratch& w) {
  const int64_t* table = a.tables + it.seq * a.MB;
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t p = j0 + jj;
    const int64_t at = ((table[p / a.block_size] * a.block_size + p % a.block_size) * a.KVH + it.kvh) * a.D;
    if constexpr (std::is_same_v<T, float>) {
      w.krows[jj] = a.k + at;
      w.vrows[jj] = a.v + at;
    } else {
      float* kd = w.kbuf.data() + jj * a.D;
      float* vd = w.vbuf.data() + jj * a.D;
      for (int64_t d = 0; d < a.D; ++d) kd[d] = static_cast<float>(a.k[at + d]), vd[d] = static_cast<float>(a.v[at + d]);
      w.krows[jj] = kd;
      w.vrows[jj] = vd;
    }
  }
}

// The query columns [from, to) that key j sees (columns are position-major: column c is position base + c / G).
struct Cols {
  int64_t from, to;
};
inline Cols visible_cols(int64_t j, int64_t base, int64_t G, int64_t M, int64_t window) {
  const int64_t from = std::clamp<int64_t>(G * (j - base), 0, M);  // causal: positions >= j
  const int64_t to = window > 0 ? std::clamp<int64_t>(G * (j - base + window), 0, M) : M;  // p < j + window
  return {from, to};
}

// ---- The portable primitives: what the vector ones below compute, for any compiler and any width.

// S^T[r][c] = sum_d krows[r][d] * qt[d][c], r < nk rows, c < cols.
inline void scores_generic(float* st, const float* const* krows, int64_t nk, const float* qt, int64_t D, int64_t ld) {
  for (int64_t r = 0; r < nk; ++r) {
    float* row = st + r * ld;
    std::fill(row, row + ld, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float x = krows[r][d];
      const float* qd = qt + d * ld;
      for (int64_t c = 0; c < ld; ++c) row[c] += x * qd[c];
    }
  }
}

// O^T[d][c] += sum_j vrows[j][d] * pt[j][c].
inline void values_generic(float* ot, const float* const* vrows, int64_t nk, const float* pt, int64_t D, int64_t ld) {
  for (int64_t d = 0; d < D; ++d) {
    float* row = ot + d * ld;
    for (int64_t j = 0; j < nk; ++j) {
      const float x = vrows[j][d];
      const float* pj = pt + j * ld;
      for (int64_t c = 0; c < ld; ++c) row[c] += x * pj[c];
    }
  }
}

// The online softmax over one key block, per query column c < M: m = max(m, masked scores), rescale O^T and l by
// exp(m_old - m), P^T = exp(S^T - m) (0 where masked), l += sum P.
inline void softmax_generic(float* st, int64_t nk, const Cols* cols, float* m, float* l, float* ot, int64_t D,
                            int64_t M, int64_t ld) {
  for (int64_t c = 0; c < M; ++c) {
    float mx = m[c];
    for (int64_t j = 0; j < nk; ++j)
      if (c >= cols[j].from && c < cols[j].to) mx = std::max(mx, st[j * ld + c]);
    const float alpha = std::exp(m[c] - mx);
    float sum = 0.f;
    for (int64_t j = 0; j < nk; ++j) {
      float& s = st[j * ld + c];
      s = (c >= cols[j].from && c < cols[j].to) ? std::exp(s - mx) : 0.f;
      sum += s;
    }
    l[c] = l[c] * alpha + sum;
    m[c] = mx;
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; ++d) ot[d * ld + c] *= alpha;
  }
}

#if defined(CONVEYOR_VEC)
using namespace conveyor_vec;

// Register tiles: MR rows x NV vectors of query columns. avx512: 6 x 4 (24 of 32 registers), avx2: 6 x 2
// (12 of 16), the rest for the loaded vectors and the broadcast.
constexpr int kMR = 6;
constexpr int kNV = W == 16 ? 4 : 2;

// C[r][c] (+)= sum_k A(r, k) * B[k][c] over MR rows, NV * W columns; A(r, k) = rows[r][k] (Rows) or
// rows[k][r] (!Rows: the rows of A are the columns of a stored matrix, e.g. V^T).
template <int MR, int NV, bool Rows>
inline void tile(float* C, int64_t ldc, const float* const* rows, int64_t off, const float* B, int64_t ldb, int64_t K,
                 bool accumulate) {
  vf c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? vload(C + r * ldc + v * W) : vzero();
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = vload(B + k * ldb + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vf x = vset1(Rows ? rows[r][off + k] : rows[k][off + r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = vfmadd(x, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(C + r * ldc + v * W, c[r][v]);
}

// MR rows over all ld columns (a multiple of W): NV vectors at a time, then single vectors.
template <int MR, bool Rows>
inline void row_tile(float* C, int64_t ld, const float* const* rows, int64_t off, const float* B, int64_t K,
                     bool accumulate) {
  int64_t c = 0;
  for (; c + kNV * W <= ld; c += kNV * W) tile<MR, kNV, Rows>(C + c, ld, rows, off, B + c, ld, K, accumulate);
  for (; c < ld; c += W) tile<MR, 1, Rows>(C + c, ld, rows, off, B + c, ld, K, accumulate);
}

// C [n x ld] (+)= A [n x K] . B [K x ld]; Rows: A(r, k) = rows[r][k], else A(r, k) = rows[k][r].
template <bool Rows>
void gemm(float* C, int64_t ld, int64_t n, const float* const* rows, const float* B, int64_t K, bool accumulate) {
  int64_t r = 0;
  auto at = [&](int64_t i) { return Rows ? rows + i : rows; };  // the rows of A from row i on
  auto off = [&](int64_t i) { return Rows ? int64_t{0} : i; };
  for (; r + kMR <= n; r += kMR) row_tile<kMR, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate);
  switch (n - r) {
    case 5: row_tile<5, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate); break;
    case 4: row_tile<4, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate); break;
    case 3: row_tile<3, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate); break;
    case 2: row_tile<2, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate); break;
    case 1: row_tile<1, Rows>(C + r * ld, ld, at(r), off(r), B, K, accumulate); break;
    default: break;
  }
}

// The online softmax step of softmax_generic, W query columns at a time. all_visible: every key of the block is
// visible to every column (the blocks below a tile's diagonal: no masks; padding columns compute harmlessly).
template <bool all_visible>
inline void softmax_vec(float* st, int64_t nk, const Cols* cols, float* m, float* l, float* ot, int64_t D, int64_t ld) {
  for (int64_t c = 0; c < ld; c += W) {
    const vf m_old = vload(m + c);
    vf mx = m_old;
    for (int64_t j = 0; j < nk; ++j)
      mx = all_visible ? vmax(mx, vload(st + j * ld + c))
                       : vmax(mx, vload_first(st + j * ld + c, vrange(cols[j].from - c, cols[j].to - c), kMasked));
    vf sum = vzero();
    for (int64_t j = 0; j < nk; ++j) {
      vf p = vexp(vsub(vload(st + j * ld + c), mx));
      if (!all_visible) p = vkeep(p, vrange(cols[j].from - c, cols[j].to - c));
      vstore(st + j * ld + c, p);
      sum = vadd(sum, p);
    }
    vstore(m + c, mx);
    if (vall_equal(mx, m_old)) {  // no column's max moved: O^T and l keep their scale (most blocks past the first)
      vstore(l + c, vadd(vload(l + c), sum));
      continue;
    }
    const vf alpha = vexp(vsub(m_old, mx));
    vstore(l + c, vfmadd(vload(l + c), alpha, sum));
    for (int64_t d = 0; d < D; ++d) vstore(ot + d * ld + c, vmul(vload(ot + d * ld + c), alpha));
  }
}
#endif

// One work item: Q^T of the tile (scaled), then the online softmax over its key blocks, then out = O^T / l.
template <typename T, bool Vec>
void run_item(const Prefill<T>& a, const Item& it, Scratch& w) {
  const int64_t G = a.H / a.KVH, D = a.D, M = G * (it.t1 - it.t0);
#if defined(CONVEYOR_VEC)
  const int64_t ld = Vec ? (M + W - 1) / W * W : M;  // query columns, padded to whole vectors
#else
  const int64_t ld = M;
#endif
  const int64_t start = a.spans[2 * it.seq], base = start + it.t0;  // column c: position base + c / G
  w.qt.assign(D * ld, 0.f);
  w.ot.assign(D * ld, 0.f);
  w.m.assign(ld, kMasked);
  w.l.assign(ld, 0.f);
  w.st.resize(kKeyBlock * ld);
  for (int64_t c = 0; c < M; ++c) {
    const float* qrow = a.q + ((a.row0[it.seq] + it.t0 + c / G) * a.H + it.kvh * G + c % G) * D;
    for (int64_t d = 0; d < D; ++d) w.qt[d * ld + c] = qrow[d] * a.sc;
  }
  const int64_t last = base + (it.t1 - it.t0) - 1;  // the last position's key
  Cols cols[kKeyBlock];
  for (int64_t j0 = first_key(base, a.window) / kKeyBlock * kKeyBlock; j0 <= last; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, last + 1 - j0);
    block_rows(a, it, j0, nk, w);
    for (int64_t jj = 0; jj < nk; ++jj) cols[jj] = visible_cols(j0 + jj, base, G, M, a.window);
#if defined(CONVEYOR_VEC)
    if constexpr (Vec) {
      gemm<true>(w.st.data(), ld, nk, w.krows.data(), w.qt.data(), D, false);
      if (cols[0].from == 0 && cols[nk - 1].from == 0 && (a.window == 0 || cols[0].to == M))
        softmax_vec<true>(w.st.data(), nk, cols, w.m.data(), w.l.data(), w.ot.data(), D, ld);
      else
        softmax_vec<false>(w.st.data(), nk, cols, w.m.data(), w.l.data(), w.ot.data(), D, ld);
      gemm<false>(w.ot.data(), ld, D, w.vrows.data(), w.st.data(), nk, true);
      continue;
    }
#endif
    scores_generic(w.st.data(), w.krows.data(), nk, w.qt.data(), D, ld);
    softmax_generic(w.st.data(), nk, cols, w.m.data(), w.l.data(), w.ot.data(), D, M, ld);
    values_generic(w.ot.data(), w.vrows.data(), nk, w.st.data(), D, ld);
  }
  for (int64_t c = 0; c < M; ++c) {
    float* orow = a.out + ((a.row0[it.seq] + it.t0 + c / G) * a.H + it.kvh * G + c % G) * D;
    const float inv = 1.f / w.l[c];
    for (int64_t d = 0; d < D; ++d) orow[d] = w.ot[d * ld + c] * inv;
  }
}

// The items, costliest first (rows x keys they see), taken one at a time by whichever thread is free: a causal
// chunk's last tiles see the most keys, so a static split of the list would leave one thread idle.
template <typename T, bool Vec>
void run_all(const Prefill<T>& a, int64_t S) {
  const int64_t G = a.H / a.KVH, per_tile = std::max<int64_t>(1, kTileCols / G);
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t start = a.spans[2 * s], n = a.spans[2 * s + 1];
    for (int64_t t0 = 0; t0 < n; t0 += per_tile) {
      const int64_t t1 = std::min(n, t0 + per_tile), keys = start + t1 - first_key(start + t0, a.window);
      for (int64_t h = 0; h < a.KVH; ++h) items.push_back({s, h, t0, t1, (t1 - t0) * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(conveyor_shares::kernel_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.krows.resize(kKeyBlock);
    w.vrows.resize(kKeyBlock);
    if constexpr (!std::is_same_v<T, float>) w.kbuf.resize(kKeyBlock * a.D), w.vbuf.resize(kKeyBlock * a.D);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) run_item<T, Vec>(a, items[i], w);
  });
}

// out/q float32 [N, H, D] (q converted by the caller); key/value float32, bfloat16 or float16 [slots, KVH, D].
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& block_tables, const at::Tensor& spans, int64_t block_size, double scale,
                       int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "prefill_attention: float32 q, out");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "prefill_attention: key and value of one dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key.is_contiguous() && value.is_contiguous(),
              "prefill_attention: contiguous tensors only");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 2 && spans.scalar_type() == at::kLong,
              "prefill_attention: spans [S, 2] int64 (start, len)");
  auto bt = block_tables.contiguous();
  auto sp = spans.contiguous();
  const int64_t S = sp.size(0);
  std::vector<int64_t> row0(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) row0[s + 1] = row0[s] + sp.data_ptr<int64_t>()[2 * s + 1];
  TORCH_CHECK(row0[S] == q.size(0), "prefill_attention: the spans' lengths must add up to q's rows");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "prefill_attention", [&] {
    const Prefill<scalar_t> a{q.size(1),     q.size(2),       key.size(1),          bt.size(1),
                              block_size,    window,          static_cast<float>(scale),
                              q.data_ptr<float>(),             out.data_ptr<float>(), key.data_ptr<scalar_t>(),
                              value.data_ptr<scalar_t>(),      bt.data_ptr<int64_t>(), sp.data_ptr<int64_t>(),
                              row0.data()};
#if defined(CONVEYOR_VEC)
    if constexpr (!std::is_same_v<scalar_t, double>) return run_all<scalar_t, true>(a, S);
#endif
    run_all<scalar_t, false>(a, S);
  });
}

}  // namespace

CONVEYOR_LIBRARY_FRAGMENT(CONVEYOR_NS, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor key, Tensor value, Tensor block_tables, "
        "Tensor spans, int block_size, float scale, int window) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
