"""The process environment beyond the CONVEYOR_* settings (shared/settings: the one package that touches it): PATH
for a build, a child service's environment, and the variables by which other libraries choose their code."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, NoReturn

# libgomp (torch's OpenMP, MKL's threads too) reads these once, when torch loads: how its threads wait at a barrier.
OMP_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

# glibc reads this once, as the process starts (before any of its code runs): the tunables its malloc runs with.
GLIBC_TUNABLES = "GLIBC_TUNABLES"
MALLOC_HUGE_PAGES = "glibc.malloc.hugetlb"  # 1: malloc's memory advised MADV_HUGEPAGE (glibc 2.35+; others ignore it)
# Set by restart_with: a process started again never starts itself a third time (a loader that drops a tunable, as
# glibc's does for a setuid program, would otherwise have it start itself for ever).
RESTARTED = "_CONVEYOR_RESTARTED"

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


def omp_environment(spin_count: int) -> dict[str, str]:
    """GOMP_SPINCOUNT=spin_count for a process whose torch threads meet at barriers, unless this environment says
    how they wait (either OMP_WAIT_VARIABLES set) or spin_count is 0. Why: libgomp's default, 300,000 spins
    (milliseconds: on recent Intel cores a PAUSE takes ~140 cycles; not measured here), keeps a thread spinning on its core long after its
    partner was preempted; beside one busy process on two cores a worker's requests then took 6-25x their quiet
    time, 5-7x with 30,000 spins, which cost nothing on a quiet machine (docs/benchmarks.md, 2026-12-07)."""
    if spin_count <= 0 or any(v in os.environ for v in OMP_WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(spin_count)}


def start_environment(malloc_huge_pages: bool) -> dict[str, str]:
    """GLIBC_TUNABLES with glibc.malloc.hugetlb=1 added (to tunables already set) when malloc_huge_pages, unless it
    names glibc.malloc.hugetlb already. Read only as a process starts: a service that lacks it starts itself again
    (restart_with). Why: on a VM a process woken after idling runs its first milliseconds with cold TLBs, and each
    miss on 4 KB pages walks the host's page tables too; the tokenizer's BPE tables on huge pages cut a cold 128-token
    prompt's tokenization from ~25 ms to ~5, and in the VM's slow minutes a single stream's first token came ~12 %
    sooner, at no cost in RSS worth naming (docs/benchmarks.md, 2026-12-07). A kernel whose THP is "never" leaves the advice unused."""
    current = os.environ.get(GLIBC_TUNABLES, "")
    if not malloc_huge_pages or MALLOC_HUGE_PAGES in current or RESTARTED in os.environ:
        return {}
    return {GLIBC_TUNABLES: ":".join(t for t in (current, f"{MALLOC_HUGE_PAGES}=1") if t)}


def restart_with(values: dict[str, str]) -> NoReturn:
    """This process replaced by the same command line under these variables added to its environment (same PID: a
    launcher, Docker or systemd keeps watching it)."""
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **values, RESTARTED: "1"})


def set_library_environment(values: dict[str, str]) -> None:
    """Sets these variables in this process's environment (before the libraries that read them load)."""
    os.environ.update(values)
