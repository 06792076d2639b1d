"""The engine's GEMV kernel (csrc/gemv.cpp) against the libraries' GEMMs, over a real model's weights, in one process.

What a decode step at a few sequences does with its linears: every weight of the model's fused forward (SmolLM2:
121 weights, 538 MB of float32, the LM head last) multiplied in forward order by M rows, so each weight comes in
from memory as it does in a step. Kernels: `linear` (F.linear: MKL's sgemm), `packed` (oneDNN on the weight
reordered into its blocked layout) and `gemv` of each ISA variant this CPU runs, with and without (`-near`, gemm.py's
*_near) its L2 prefetches. Passes alternate across the kernels (drift hits all alike); the median pass is reported,
as ms and as GB/s of weights, with each kernel's ratio to F.linear, next to a read of a 1 GiB tensor on the same
threads (torch.sum: the memory's read rate).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.gemv [--rows 1,2,4,8,16,32,64] [--passes 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.decode_floor import read_bandwidth
from services.worker.engine import EngineConfig, LLMEngine, cpu_ops, gemm
from services.worker.engine.cpu_info import this_cpu
from shared.model_files import resolve_model_dir
from shared.settings import CommonSettings


def kernels(cache_dir: str) -> dict:
    out = {"linear": lambda x, w, p: F.linear(x, w), "packed": lambda x, w, p: gemm._packed(x, w, None, p)}
    for isa in cpu_ops.available():
        if isa != "portable" and (ops := cpu_ops.build(isa, cache_dir)) is not None:
            out[f"gemv-{isa}"] = (lambda o: lambda x, w, p: o.gemv(x, w, None, gemm.FAR_LINES))(ops)
            out[f"gemv-{isa}-near"] = (lambda o: lambda x, w, p: o.gemv(x, w, None, 0))(ops)  # no L2 prefetches
    return out


@torch.inference_mode()
def passes(weights: list, packs: list, rows: int, fns: dict, n: int) -> dict[str, float]:
    """-> the median seconds of a pass over every weight, per kernel."""
    xs = [torch.randn(rows, w.shape[1]) for w in weights]
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(n + 1):  # the first pass of each kernel warms it up
        for name, fn in fns.items():
            t = time.perf_counter()
            for w, p, x in zip(weights, packs, xs):
                fn(x, w, p)
            if i:
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()
    s = CommonSettings()
    engine = LLMEngine.from_model_dir(
        resolve_model_dir(s.model, s.cache_dir), EngineConfig(gemm_tuning=False, tuning_cache_dir=str(s.cache_dir))
    )
    weights = [lin.weight.detach() for lin in engine.runner.fused.linears()]
    packs = [gemm.pack(w) for w in weights]
    total = sum(w.nbytes for w in weights)
    fns = kernels(str(s.cache_dir))
    buf = torch.ones((1 << 30) // 4)
    print(f"{this_cpu().name}; {torch.get_num_threads()} threads; {len(weights)} weights, {total / 1e6:.0f} MB")
    for rows in map(int, args.rows.split(",")):
        read, _ = read_bandwidth(buf, 3)
        med = passes(weights, packs, rows, fns, args.passes)
        cells = [f"{k} {t * 1e3:6.2f} ms {total / t / 1e9:5.1f} GB/s x{med['linear'] / t:4.2f}" for k, t in med.items()]
        print(f"M={rows:<3} read {read:5.1f} GB/s | " + " | ".join(cells))


if __name__ == "__main__":
    main()
