"""The engine's own CPU kernels (csrc/*.cpp), compiled once per machine and loaded as torch ops.

Why C++: the paged decode attention (paged_decode.cpp) reads each sequence's K/V where it lies in the
pool; in torch ops the same product needs a gather copy of every sequence's K/V per layer first (a third
of a batch-32 decode step on the 2-core VM of docs/benchmarks.md). layer_ops.cpp fuses the small per-layer
ops of the fused forward (fused_llama.py): residual add + RMSNorm, rotary, SiLU * up; sampling.cpp the
sampler's inverse-CDF draw (sampler.py). The build
(torch.utils.cpp_extension, ninja, the system C++ compiler, -march=native) takes ~10 s on the 2-core VM; its output is kept under the cache directory,
keyed by the source, the torch build and the CPU, so a restarted worker only loads it (< 1 s).
Anything that stops the build (no compiler, no ninja, an error) is logged once and the engine keeps
its torch path: same results, slower.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from shared.settings import this_pythons_bin_on_path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_decode.cpp", CSRC / "layer_ops.cpp", CSRC / "sampling.cpp")
HEADERS = (CSRC / "vec.h",)
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")


def _build_name() -> str:
    from services.worker.engine.gemm import cpu_name

    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join((torch.__version__, cpu_name(), *CFLAGS)).encode())
    return "conveyor_cpu_" + h.hexdigest()[:16]


_state: dict[str, bool] = {}  # "loaded": the outcome, once per process (a library registers its ops only once)


def load(cache_dir: str | None) -> bool:
    """Build (or find built) and load the kernels; True when torch.ops.conveyor.* are usable."""
    if "loaded" not in _state:
        _state["loaded"] = _build_and_load(cache_dir)
    return _state["loaded"]


def _build_and_load(cache_dir: str | None) -> bool:
    try:
        from torch.utils import cpp_extension

        name = _build_name()
        root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "conveyor"
        build_dir = root / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        # cpp_extension runs `ninja` by name; a worker started as .venv/bin/python may lack that bin on PATH
        with this_pythons_bin_on_path():
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        ok = all(
            hasattr(torch.ops.conveyor, op)
            for op in ("paged_decode", "add_rms_norm", "rotary", "silu_mul", "sample_rows")
        )
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
        logger.warning(
            "CPU kernels unavailable (%s: %s); paged attention gathers K/V in torch instead",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return False
    logger.info("CPU kernels loaded (%s)", name)
    return ok
