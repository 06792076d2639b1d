"""The engine's GEMV and panel GEMM (csrc/gemv.cpp, panel_gemm.cpp) against the libraries' GEMMs, over a real
model's weights, in one process.

What a step does with its linears: every weight of the model's fused forward (SmolLM2: 121 weights, 538 MB of
float32, the LM head last) multiplied in forward order by M rows, so each weight comes in from memory as it does in
a step. Kernels: `linear` (F.linear: MKL's sgemm), `packed` (oneDNN on the weight reordered into its blocked
layout), `gemv` of each ISA variant this CPU runs, with and without (`-near`, gemm.py's *_near) its L2 prefetches,
up to its 64 rows, `panel` (the engine's build, on the weight's panel copy) and on avx512 `panel8` (the same with
tiles of 8 rows at any row count), `coded` (csrc/coded_gemm.cpp on the 4- or 8-bit codes of each weight that is such
blocks: SmolLM2's linears and its LM head; the panel GEMM on any other). The weights and their copies lie on huge pages where the kernel allows, as in the
engine (huge_pages.advise). Passes alternate across the kernels
(drift hits all alike); the median pass is reported, as ms, as GB/s of weights and as GFLOPS, with each kernel's
ratio to F.linear, next to a read of a 1 GiB tensor on the same threads (torch.sum: the memory's read rate).
With --baseline REV the panel GEMM as it was at git revision REV is built too (decode_attention.build_baseline: same
flags, a namespace of its own) and measured in the same passes, on its own panel copies (`panel@REV`, and on avx512
`panel8@REV`: a revision from before the 8-row tiles' `wide` cannot run it), and its GEMM on codes (`coded@REV`, on
its own records; a revision from before csrc/coded_gemm.cpp has none).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.gemv [--rows 1,2,4,8,16,32,64,128] [--passes 7]
     [--baseline REV]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.engine.decode_attention import build_baseline
from benchmarks.engine.decode_floor import read_bandwidth
from services.worker.engine import EngineConfig, LLMEngine
from services.worker.engine.cpu import cpu_ops, gemm
from services.worker.engine.model import huge_pages
from services.worker.engine.cpu.cpu_info import this_cpu
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings


def kernels(cache_dir: str) -> dict:
    """name -> (fn(x, w, copy), the copy it reads: a gemm.COPIES key or None, most rows)."""
    out = {"linear": (lambda x, w, c: F.linear(x, w), None, None)}
    out["packed"] = (lambda x, w, c: gemm.KERNELS["packed"](x, w, None, c), "packed", None)
    for isa in cpu_ops.available():
        if isa != "portable" and (ops := cpu_ops.build(isa, cache_dir)) is not None:
            out[f"gemv-{isa}"] = (_gemv(ops, gemm.FAR_LINES), None, gemm.GEMV_MAX_ROWS)
            out[f"gemv-{isa}-near"] = (_gemv(ops, 0), None, gemm.GEMV_MAX_ROWS)  # no L2 prefetches
    if cpu_ops.vector_path():
        out["panel"] = (lambda x, w, c: cpu_ops.ops().panel_gemm(x, c, None, w.shape[0]), "panel", None)
    if cpu_ops.active_isa() == "avx512":  # tiles of 8 rows at any row count (gemm_kernels' panel8)
        out["panel8"] = (lambda x, w, c: cpu_ops.ops().panel_gemm(x, c, None, w.shape[0], True), "panel", None)
    if cpu_ops.vector_path():  # the codes where the weight is such blocks, else the panel GEMM
        out["coded"] = (_coded_by(cpu_ops.ops()), "coded|panel", None)
    return out


def _coded_copy(ops):
    """w -> (bits, copy) by a build's ops: its records of w's codes (q4, else q8; coded_recover.cpp finds them), or
    (0, its panel copy) for a weight that is not such blocks."""

    def make(w: torch.Tensor) -> tuple[int, torch.Tensor]:
        for bits in (4, 8):
            if found := getattr(ops, f"recover_q{bits}")(w):
                return bits, getattr(ops, f"pack_q{bits}")(*found)
        return 0, ops.pack_panels(w)

    return make


def _coded_by(ops):
    """A build's GEMM on the codes of _coded_copy's copy, its panel GEMM on any other weight."""

    def run(x: torch.Tensor, w: torch.Tensor, c: tuple[int, torch.Tensor]) -> torch.Tensor:
        bits, copy = c
        if not bits:
            return ops.panel_gemm(x, copy, None, w.shape[0], cpu_ops.active_isa() == "avx512")
        return ops.coded_gemm(x, copy, None, w.shape[0], bits)

    return run


def _gemv(ops, far_lines: int):
    return lambda x, w, c: ops.gemv(x, w, None, far_lines)


@torch.inference_mode()
def passes(weights: list, copies: dict, rows: int, fns: dict, n: int) -> dict[str, float]:
    """-> the median seconds of a pass over every weight, per kernel."""
    xs = [torch.randn(rows, w.shape[1]) for w in weights]
    here = {k: v for k, v in fns.items() if v[2] is None or rows <= v[2]}
    times: dict[str, list[float]] = {k: [] for k in here}
    for i in range(n + 1):  # the first pass of each kernel warms it up
        for name, (fn, copy, _) in here.items():
            cs = copies[copy] if copy else [None] * len(weights)
            t = time.perf_counter()
            for w, c, x in zip(weights, cs, xs):
                fn(x, w, c)
            if i:
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument(
        "--baseline", help="a git revision whose panel GEMM and GEMM on codes to measure beside this tree's"
    )
    args = ap.parse_args()
    s = CommonSettings()
    engine = LLMEngine.from_model_dir(
        resolve_model_dir(s.model, s.cache_dir),
        EngineConfig(gemm_tuning=False, tuning_cache_dir=str(s.cache_dir)),
    )
    weights = [lin.weight.detach() for lin in engine.runner.fused.linears()]
    fns = kernels(str(s.cache_dir))
    makers = dict(gemm.COPIES)
    if cpu_ops.vector_path():
        makers["coded|panel"] = _coded_copy(cpu_ops.ops())
    if args.baseline and cpu_ops.vector_path():
        base = build_baseline(args.baseline, cpu_ops.active_isa())
        makers["baseline"] = base.pack_panels
        fns[f"panel@{args.baseline}"] = (lambda x, w, c: base.panel_gemm(x, c, None, w.shape[0]), "baseline", None)
        if "panel8" in fns:  # the revision's 8-row tiles at any row count (its panel_gemm takes `wide`)
            fns[f"panel8@{args.baseline}"] = (
                lambda x, w, c: base.panel_gemm(x, c, None, w.shape[0], True),
                "baseline",
                None,
            )
        if hasattr(base, "coded_gemm"):  # the revision's GEMM on codes, on its own records
            makers["baseline-coded"] = _coded_copy(base)
            fns[f"coded@{args.baseline}"] = (_coded_by(base), "baseline-coded", None)
    copies = {name: [makers[name](w) for w in weights] for name in {c for _, c, _ in fns.values() if c}}
    huge_pages.advise()  # the copies made after the engine's own advice
    total = sum(w.nbytes for w in weights)
    buf = torch.ones((1 << 30) // 4)
    print(f"{this_cpu().name}; {torch.get_num_threads()} threads; {len(weights)} weights, {total / 1e6:.0f} MB")
    for rows in map(int, args.rows.split(",")):
        read, _ = read_bandwidth(buf, 3)
        med = passes(weights, copies, rows, fns, args.passes)
        flops = 2 * rows * sum(w.numel() for w in weights)
        cells = [
            f"{k} {t * 1e3:6.2f} ms {total / t / 1e9:5.1f} GB/s {flops / t / 1e9:5.0f} GF x{med['linear'] / t:4.2f}"
            for k, t in med.items()
        ]
        print(f"M={rows:<3} read {read:5.1f} GB/s | " + " | ".join(cells))


if __name__ == "__main__":
    main()
