"""The process environment beyond the CONVEYOR_* settings (shared/settings: the one package that touches it): PATH
for a build, a child service's environment, and the variables by which other libraries choose their code."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

# By these ATen, oneDNN and MKL hold their kernels to a narrower ISA than the CPU's (each reads it at its start).
LIBRARY_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@contextlib.contextmanager
def this_pythons_bin_on_path() -> Iterator[None]:
    """While it lasts, PATH starts with this interpreter's bin folder (a venv's tools, e.g. the pinned ninja, for a
    process started as .venv/bin/python); restored after."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), old))
    try:
        yield
    finally:
        os.environ["PATH"] = old


def child_environment(**overrides: str) -> dict[str, str]:
    """The environment for a child service process: this one's, with some CONVEYOR_* settings."""
    return {**os.environ, **overrides}


def library_isa_limits() -> tuple[str, ...]:
    """This process's values of LIBRARY_ISA_VARIABLES, "" where unset: part of what code it runs (gemm.key)."""
    return tuple(os.environ.get(v, "") for v in LIBRARY_ISA_VARIABLES)
