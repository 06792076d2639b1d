"""Does this CPU overlap a memory stream with arithmetic? A roofline check, in one process (issue 29).

A decode step at batch 32 streams every weight from memory while its GEMMs keep both cores' FMA units busy; how
much of the one hides behind the other decides whether a kernel's time is max(memory, compute) or their sum, and
whether software prefetches are what makes the difference. This measures it without any of the engine's kernels:
each thread reads its half of a 512 MB buffer once, a vector at a time, and spends F FMAs on each 64-byte line
(8 accumulators, so the FMAs wait on nothing but the loads), for F in --fmas:

  stream       the loads alone (the hardware prefetchers only)
  near T0      plus a PREFETCHT0 --near lines ahead of the loads (into L1)
  far T1       plus a PREFETCHT1 --far lines ahead (into L2)

and, as the compute alone, the same FMAs over a cache-resident 128 KB buffer read as many times (in one call). Prints ms per
512 MB and each variant's ratio to max(read, compute): 1.0 is full overlap; (read + compute) / max is none. The
ISA is the kernels' (cpu_ops.active_isa(): 512-bit vectors on avx512, 256-bit otherwise).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.overlap [--fmas 0,8,16,32] [--near 32] [--far 128]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.cpp_extension import load_inline

from benchmarks.common import median_s
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.cpu.cpu_info import this_cpu

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#ifdef __AVX512F__
using V = __m512;
#define LOAD _mm512_load_ps
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
constexpr int kLanes = 16;
#else
using V = __m256;
#define LOAD _mm256_load_ps
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
constexpr int kLanes = 8;
#endif

// F FMAs per vector of a 64-byte line of w (16 x F lane FMAs a line on either ISA), each thread its share, `passes`
// times, prefetching `ahead` lines ahead with `hint` (0: none, 1: T0, 2: T1). Returns a sum so that nothing is
// optimized away.
template <int F>
double run(const float* w, int64_t n, int64_t ahead, int64_t hint, int64_t passes) {
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int64_t per = n / omp_get_num_threads() / 16 * 16;
    const float* p = w + omp_get_thread_num() * per;
    V acc[8], x[8];
    for (int j = 0; j < 8; ++j) acc[j] = SET1(0.f), x[j] = SET1(1.f + j * 1e-3f);
    for (int64_t k = 0; k < passes; ++k)
    for (int64_t i = 0; i < per; i += 16) {
      const char* pf = reinterpret_cast<const char*>(p + i + ahead * 16);
      if (hint == 1 && i + ahead * 16 < per) _mm_prefetch(pf, _MM_HINT_T0);
      if (hint == 2 && i + ahead * 16 < per) _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 2
      for (int v = 0; v < 16; v += kLanes) {
        const V b = LOAD(p + i + v);
        acc[0] = FMA(b, x[0], acc[0]);
#pragma GCC unroll 64
        for (int f = 1; f < F; ++f) acc[f % 8] = FMA(b, x[f % 8], acc[f % 8]);
      }
    }
    float out[kLanes];
    for (int j = 1; j < 8; ++j) acc[0] = FMA(acc[j], x[0], acc[0]);
    std::memcpy(out, &acc[0], sizeof(out));
    for (float o : out) total += o;
  }
  return total;
}

double stream(torch::Tensor w, int64_t fmas, int64_t ahead, int64_t hint, int64_t passes) {
  const float* p = w.data_ptr<float>();
  const int64_t n = w.numel();
  switch (fmas) {
    case 1: return run<1>(p, n, ahead, hint, passes);
    case 8: return run<8>(p, n, ahead, hint, passes);
    case 16: return run<16>(p, n, ahead, hint, passes);
    case 32: return run<32>(p, n, ahead, hint, passes);
    default: TORCH_CHECK(false, "fmas: 1, 8, 16 or 32");
  }
}
"""


def build(isa: str):
    flags = ["-O3", "-fopenmp", "-mavx2", "-mfma"] + (["-mavx512f"] if isa == "avx512" else [])
    return load_inline(
        f"conveyor_overlap_{isa}",
        cpp_sources=SOURCE,
        functions=["stream"],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=tempfile.mkdtemp(prefix="conveyor-overlap-"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmas", default="1,8,16,32", help="FMAs per 64-byte line (1, 8, 16, 32)")
    ap.add_argument("--near", type=int, default=32, help="lines ahead for the T0 prefetches")
    ap.add_argument("--far", type=int, default=128, help="lines ahead for the T1 prefetches")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    isa = cpu_ops.choose("auto")
    if isa == "portable":
        raise SystemExit("no avx2 or avx512 on this CPU")
    ops = build(isa)
    big = torch.ones(128 * 2**20)  # 512 MB
    small = torch.ones(32 * 2**10)  # 128 KB: each thread's half stays in its L2
    repeat = big.numel() // small.numel()
    print(f"{this_cpu().name}; {torch.get_num_threads()} threads; {isa} vectors; 512 MB read once per pass")
    read = median_s(lambda: ops.stream(big, 1, 0, 0, 1), args.reps)
    print(f"a read with 1 FMA a line: {read * 1e3:.1f} ms ({big.nbytes / read / 1e9:.1f} GB/s)")
    for f in map(int, args.fmas.split(",")):
        compute = median_s(lambda: ops.stream(small, f, 0, 0, repeat), args.reps)
        ideal = max(read, compute)
        cells = [f"F={f:2d}  compute {compute * 1e3:6.1f} ms  (none would be x{(read + compute) / ideal:.2f})"]
        for name, ahead, hint in (("stream", 0, 0), ("near T0", args.near, 1), ("far T1", args.far, 2)):
            t = median_s(lambda: ops.stream(big, f, ahead, hint, 1), args.reps)
            cells.append(f"{name} {t * 1e3:6.1f} ms x{t / ideal:.2f}")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
