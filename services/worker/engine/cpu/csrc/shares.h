// Work of one parallel call shared out between its threads: each thread takes its own share in chunks from the
// front, then, once done, half of what is left of another's from its back (work stealing, as in Cilk or TBB,
// without a deque: a share is one range of indices).
//
// Why not a static split (each thread one contiguous run, what at::parallel_for gives): on the 2-vCPU VMs of
// docs/benchmarks.md the host slows one vCPU and not the other for tenths of a second at a time (a loop of FMAs pinned
// to each, both at once, 2026-12-06 on the Zen 3: one at 62-89 % of the other's rate in 12 of 48 samples, no steal time
// counted in the served rounds), and a step's every GEMM then waits at its end for the slower thread's half. Why each
// thread starts on its own share, in order: a run of consecutive panels keeps the kernels' loads ahead running on into
// the next panel (handing chunks out in turn from one counter was 14 % slower at 32 rows, docs/benchmarks.md,
// 2026-12-06); stealing from a share's back leaves its owner's front, and the panels it is loading ahead, alone. Which
// thread computes an index changes nothing in what is computed: the GEMMs' results are the same to the bit.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace conveyor_shares {

// The threads a kernel's at::parallel_for runs on: 1 inside another parallel region (a run of the layer stack's
// split decode step, csrc/layer_stack.cpp), where parallel_for calls its body inline on the calling thread: work
// shared out for more threads would only be done one share after the other (a split sequence's parts merged for
// nothing, a scratch per thread that no thread but one uses).
inline int64_t kernel_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

class Shares {
 public:
  // [0, n) (n < 2^32) in `threads` shares of equal size, handed out in chunks of about 1 / `parts` of a share (at
  // least one).
  Shares(int64_t n, int64_t threads, int64_t parts = 8)
      : threads_(std::max<int64_t>(1, threads)), share_(new Share[threads_]) {
    for (int64_t j = 0; j < threads_; ++j) {
      const int64_t b = n * j / threads_, e = n * (j + 1) / threads_;
      share_[j].range.store(pack(b, e), std::memory_order_relaxed);
      share_[j].end = e;
    }
    chunk_ = std::max<int64_t>(1, (n + threads_ * parts - 1) / (threads_ * parts));
  }

  // Thread j's next chunk [begin, end), and `limit`: how far past it the same thread will go on reading in order
  // (its own share's end; a stolen chunk's own end). False when no work is left anywhere.
  bool next(int64_t j, int64_t& begin, int64_t& end, int64_t& limit) {
    if (take(share_[j].range, true, begin, end)) {
      limit = share_[j].end;
      return true;
    }
    for (int64_t i = 1; i < threads_; ++i) {  // the others' shares, the next thread's first
      if (take(share_[(j + i) % threads_].range, false, begin, end)) {
        limit = end;
        return true;
      }
    }
    return false;
  }

 private:
  struct alignas(64) Share {  // one cache line each: the owner's takes do not contend with the other shares'
    std::atomic<uint64_t> range{0};  // [front, back): front in the low 32 bits, back in the high
    int64_t end = 0;
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }

  bool take(std::atomic<uint64_t>& range, bool front, int64_t& begin, int64_t& end) const {
    uint64_t r = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(r & 0xffffffffu), b = static_cast<int64_t>(r >> 32);
      if (f >= b) return false;
      begin = front ? f : b - (b - f + 1) / 2;  // a thief takes half of what is left: both then end together
      end = front ? std::min(b, f + chunk_) : b;
      const uint64_t want = front ? pack(end, b) : pack(f, begin);
      if (range.compare_exchange_weak(r, want, std::memory_order_relaxed)) return true;
    }
  }

  int64_t threads_, chunk_ = 1;
  std::unique_ptr<Share[]> share_;
};

// run(j, b, begin, end, limit) over [0, n) once for each of `blocks` blocks (a GEMM's blocks of x rows), by this
// call's threads (j: 0 .. threads - 1, for a scratch of each thread's own): each block's [0, n) shared out as above,
// a thread going on to the next block once no work of this one is left.
template <typename Run>
void share_out(int64_t n, int64_t blocks, Run&& run) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(kernel_threads(), n));
  std::vector<Shares> shares;
  for (int64_t b = 0; b < blocks; ++b) shares.emplace_back(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t begin, end, limit; shares[b].next(j, begin, end, limit);) run(j, b, begin, end, limit);
  });
}

}  // namespace conveyor_shares
