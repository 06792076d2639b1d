"""Both servers held to AVX2 on a CPU that has AVX-512: the next best thing to an AVX2-only machine when the
session has none (the caches, the memory and the clock stay this CPU's, so it is a proxy, not the same machine).

Conveyor: its kernels' avx2 variant (CONVEYOR_CPU_ISA) and torch's own kernels held to AVX2. vLLM: the same
libraries held, and its own kernel library chosen as on an AVX2 CPU (peer_avx2/sitecustomize.py). ATen, oneDNN
and MKL read these variables when they start: both servers' processes are started with them.
"""

from __future__ import annotations

import os
from pathlib import Path

LIBRARIES_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SHIM = Path(__file__).resolve().parent / "peer_avx2"


def conveyor_env(isa: str) -> dict[str, str]:
    """The Conveyor cluster's extra environment for `isa` (auto: none)."""
    return {} if isa == "auto" else {"CONVEYOR_CPU_ISA": "avx2", **LIBRARIES_AVX2}


def vllm_env(isa: str) -> dict[str, str]:
    """vLLM's extra environment for `isa` (auto: none)."""
    if isa == "auto":
        return {}
    path = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
    return {"CONVEYOR_PEER_ISA": "avx2", "PYTHONPATH": path, **LIBRARIES_AVX2}
