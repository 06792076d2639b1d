"""The formulations of `y = x @ W.T (+ b)` the GEMM plans (gemm.py) choose from, and the weight copies some need.

Each kernel takes (x [M, K], w [N, K], b [N] or None, copy) -> y [M, N], where `copy` is the layer's copy of the
weight in the layout that kernel reads (COPIES makes it once per layer; None for kernels that read `w`):
  linear   F.linear (MKL sgemm, the weight as the transposed operand)
  flipped  (W @ x.T).T: the same products and sums, the other operand order, another kernel
  onednn   oneDNN's linear (the primitive torch.compile's CPU backend uses)
  packed   oneDNN's linear on a copy of the weight reordered once into its blocked layout (what vLLM's
           CPU build and inductor's freezing do)
  gemv     the engine's own kernel for up to GEMV_MAX_ROWS rows (csrc/gemv.cpp): each thread streams
           whole rows with software prefetches; offered only where the CPU kernels load with a vector path
  gemv256  the same kernel of the avx2 build, beside an avx512 one (cpu_ops.narrow_ops)
  gemv_near, gemv256_near  the same two without L2 prefetches, to NEAR_MAX_ROWS rows: on a 2-core Xeon those gain
           up to 20 % at 4 rows, on an AMD Zen 3 they cost 9-17 % at 1-4 rows (docs/benchmarks.md): measured, not set
  panel    the engine's own register-tiled GEMM (csrc/panel_gemm.cpp) on a copy of the weight in K-major panels:
           on the Zen 3 of docs/benchmarks.md 15-20 % faster than gemv at 8-64 rows and than MKL from 128 rows up
  panel8   the same on the same copy with register tiles of 8 rows at any row count (the default: at 5-16 rows),
           avx512 builds only: on a 2-core Xeon 8-12 % faster at 32 and 128-512 rows, on a Zen 4 2-9 % slower at
           32-64 (docs/benchmarks.md): measured, not set
  q4, q8   the engine's GEMM on codes (csrc/coded_gemm.cpp) on a copy of the weight as 4-bit codes with a d and an m
           per 32 values, or 8-bit codes with a d, for a weight that is exactly such blocks (a GGUF Q4_1 or Q8_0
           tensor converted to float32: coded.py): each value rebuilt to the bit in L1, the panel GEMM's result to the
           bit from a sixth (a third) of the bytes
The order of KERNELS is csrc/layer_stack.cpp's LinearKernel enum (KERNEL_CODES), which runs the plans' kernels in C++.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from services.worker.engine.cpu import cpu_ops

_PACK_ROWS = 32  # the M oneDNN lays a packed weight out for (any M runs on it; vLLM's CPU build uses 32 too)


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N / C), K, C] (csrc/panel_gemm.cpp; C: its kPanelCols, 24 on avx2, 48 on avx512)."""
    if cpu_ops.active_isa() is None:
        raise RuntimeError("the engine's CPU kernels are not loaded")
    return cpu_ops.ops().pack_panels(w)


def _pack_coded(bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """w [N, K] -> csrc/coded_gemm.cpp's records of `bits`-bit codes; RuntimeError for a weight that is not such
    blocks (found by csrc/coded_recover.cpp: coded.py's search, its reference, in a fifth of the time)."""

    def pack_coded(w: torch.Tensor) -> torch.Tensor:
        if cpu_ops.active_isa() is None:
            raise RuntimeError("the engine's CPU kernels are not loaded")
        found = getattr(cpu_ops.ops(), f"recover_q{bits}")(w.detach())
        if not found:
            raise RuntimeError(f"the weight is not {bits}-bit blocks of 32 values (coded.py)")
        return getattr(cpu_ops.ops(), f"pack_q{bits}")(*found)

    return pack_coded


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _flipped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(w, x.t()).t().contiguous()  # [N, K] @ [K, M] -> [N, M] -> [M, N]
    return y if b is None else y + b


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, copy, b, "none", [], "")


def _panel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    return cpu_ops.ops().panel_gemm(x, copy, b, w.shape[0])


def _panel8(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, copy: torch.Tensor | None) -> torch.Tensor:
    return cpu_ops.ops().panel_gemm(x, copy, b, w.shape[0], True)


def _coded(bits: int) -> Callable[..., torch.Tensor]:
    return lambda x, w, b, copy: cpu_ops.ops().coded_gemm(x, copy, b, w.shape[0], bits)


def _own(build: Callable[[], Any], far_lines: int) -> Callable[..., torch.Tensor]:
    """csrc/gemv.cpp of a build (cpu_ops.ops: the engine's, narrow_ops: the avx2 one beside avx512)."""
    return lambda x, w, b, copy: build().gemv(x, w, b, far_lines)


FAR_LINES = 128  # csrc/gemv.cpp's kFarLines: its L2 prefetch distance in cache lines
KERNELS = dict(linear=_linear, flipped=_flipped, onednn=_onednn, packed=_packed)
KERNELS |= dict(gemv=_own(cpu_ops.ops, FAR_LINES), gemv256=_own(cpu_ops.narrow_ops, FAR_LINES))
KERNELS |= dict(gemv_near=_own(cpu_ops.ops, 0), gemv256_near=_own(cpu_ops.narrow_ops, 0))
KERNELS |= dict(panel=_panel, panel8=_panel8, q4=_coded(4), q8=_coded(8))
KERNEL_CODES = {name: i for i, name in enumerate(KERNELS)}
# the copies of the weight some kernels read, by kind, and how one is made (once per layer whose plan needs it)
COPIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = dict(packed=pack, panel=pack_panels)
COPIES |= dict(q4=_pack_coded(4), q8=_pack_coded(8))
COPY_OF = dict(packed="packed", panel="panel", panel8="panel", q4="q4", q8="q8")  # kernel -> the copy it reads
SMALL_COPIES = ("q4", "q8")  # a sixth or a third of the weight: a plan may hold one beside a float32 copy
GEMV_MAX_ROWS = 64  # csrc/gemv.cpp's kGemvMaxRows: the rows one call takes
# register tiles from 8 rows (avx512: 2), where *_near only drops a run's first burst: 3-4 % at 8 rows, level from 16
NEAR_MAX_ROWS = 8
# a kernel is measured (and chosen) only for buckets of at most this many rows
MAX_ROWS = {"gemv": GEMV_MAX_ROWS, "gemv256": GEMV_MAX_ROWS, "gemv_near": NEAR_MAX_ROWS, "gemv256_near": NEAR_MAX_ROWS}


def copy_for(name: str, module: torch.nn.Linear) -> torch.Tensor:
    """COPIES[name] of the module's weight; a coded one (SMALL_COPIES) made once: gemm.tune_linears asks first, to
    key the plan by it (whether a weight is coded blocks is a property of its values, not of its shape), and
    gemm.apply_plan drops what its plan does not take. RuntimeError where it cannot be made."""
    if name not in SMALL_COPIES:
        return COPIES[name](module.weight.detach())
    made = module.__dict__.setdefault("conveyor_coded", {})
    if name not in made:
        try:
            made[name] = COPIES[name](module.weight.detach())
        except RuntimeError:
            made[name] = None
    if made[name] is None:
        raise RuntimeError(f"the weight is not blocks of {name}'s codes (coded.py)")
    return made[name]


def offered(gemv: bool) -> tuple[str, ...]:
    """The kernels plans choose from; the engine's own (gemv, panel, q4, q8) only when its CPU kernels are loaded with a
    vector path (their portable loops are slower than any library's), gemv256 besides where cpu_ops.narrow_ops has
    one, panel8 where that path is avx512."""
    narrow = gemv and cpu_ops.narrow_ops() is not None
    wide = gemv and cpu_ops.active_isa() == "avx512"  # panel8's tiles differ from panel's with 16 lanes only
    own = dict(
        gemv=gemv, gemv256=narrow, gemv_near=gemv, gemv256_near=narrow, panel=gemv, panel8=wide, q4=gemv, q8=gemv
    )
    return tuple(n for n in KERNELS if own.get(n, True))
