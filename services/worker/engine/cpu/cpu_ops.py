"""The engine's own CPU kernels (csrc/*.cpp), compiled once per machine and ISA and loaded as torch ops.

Why C++: the paged decode attention (paged_decode.cpp) reads each sequence's K/V where it lies in the
pool; in torch ops the same product needs a gather copy of every sequence's K/V per layer first (a third
of a batch-32 decode step on the 2-core VM of docs/benchmarks.md). layer_ops.cpp fuses the small per-layer
ops of the fused forward (fused_llama.py): residual add + RMSNorm, rotary, SiLU * up; sampling.cpp the
sampler's inverse-CDF draw (sampler.py); gemv.cpp a linear layer at a few rows, one more kernel the GEMM plans
(gemm.py) choose from; layer_stack.cpp a step's layers in one call (the fused forward's loop).

Which ISA: the sources are built as one extension per variant (ISAS: avx512, avx2, portable), each with
explicit flags rather than -march=native, so that what runs is named, and every variant this CPU can run
is testable on it (tests/e2e/engine/test_engine_cpu_kernels.py compares each with torch). Each registers
its ops under its own namespace, torch.ops.conveyor_<isa>, so that several can be loaded in one process;
the engine uses the one load() picked: the best the CPU's flags allow, or the one forced by
CONVEYOR_CPU_ISA (a forced one the CPU lacks would die on its first instruction: auto's pick instead, with
a warning). Why not one build with runtime dispatch inside: the vector code is written once over vec.h's
vocabulary and compiled per width; separate builds keep each variant's flags (and the compiler's own
vectorisation of the plain loops) confined to it.

The build (torch.utils.cpp_extension, ninja, the system C++ compiler; one translation unit, csrc/kernels.cpp)
takes ~30 s a variant on the 2-core VM; its output is kept under the cache directory, in a folder named by the
variant, a digest of the CPU's ISA flags and of the sources, the torch build and the CPU (cpu_info.py), so a
restarted worker only loads it (< 1 s) and a cache copied from another CPU is never reused; the KEPT_BUILDS
builds loaded last are kept, older ones removed. Anything that stops the
build (no compiler, no ninja, an error) is logged once and the engine keeps its torch path: same results, slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from services.worker.engine.cpu.cpu_info import CpuInfo, this_cpu
from shared.settings import CPU_ISAS, this_pythons_bin_on_path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "kernels.cpp",)  # the one translation unit: it includes the sources below
# everything kernels.cpp includes, read from the folder: a file added there can never be left out of the digest
HEADERS = tuple(sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h") and p not in SOURCES))
CFLAGS = ("-O3", "-ffast-math", "-fopenmp")
ISA_CFLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}
# /proc/cpuinfo flags each variant's instructions need (its -m flags, by the kernel's names)
ISA_NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
OPS = (
    "paged_decode",
    "prefill_attention",
    "add_rms_norm",
    "rotary",
    "silu_mul",
    "sample_rows",
    "gemv",
    "pack_panels",
    "panel_gemm",
    "layer_stack",
)


def missing(isa: str, cpu: CpuInfo | None = None) -> frozenset[str]:
    """The CPU flags variant `isa` needs that this CPU (or `cpu`) lacks; empty = it runs here."""
    return ISA_NEEDS[isa] - (cpu or this_cpu()).flags


def available(cpu: CpuInfo | None = None) -> tuple[str, ...]:
    """The variants this CPU runs, best first (portable always)."""
    return tuple(isa for isa in CPU_ISAS if not missing(isa, cpu))


def choose(requested: str, cpu: CpuInfo | None = None) -> str:
    """The variant to load for the setting `requested` (auto or one of CPU_ISAS)."""
    best = available(cpu)[0]
    if requested == "auto":
        return best
    lacking = missing(requested, cpu)
    if lacking:
        logger.warning(
            "cpu_isa=%s needs CPU flags %s this CPU lacks: the CPU kernels use %s",
            requested,
            ",".join(sorted(lacking)),
            best,
        )
        return best
    return requested


def namespace(isa: str) -> str:
    return f"conveyor_{isa}"


@functools.cache
def sources_digest() -> str:
    """A digest of the kernels' sources: what the builds are named by, and what the GEMM plans (gemm.key) are
    keyed by, so that a changed kernel is built and measured again instead of its old plan being reused."""
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    return h.hexdigest()[:12]


def build_name(isa: str, cpu: CpuInfo | None = None) -> str:
    """The build folder and library name: the variant and the CPU's ISA flags in clear, the rest digested. The
    paths of the sources and of torch are in it: torch's build files name them, and a folder shared by two
    checkouts (or venvs) was rebuilt by each for the other, 60 s of a worker's start."""
    cpu = cpu or this_cpu()
    h = hashlib.sha256(sources_digest().encode())
    paths = (str(SOURCES[0].parent.resolve()), str(Path(torch.__file__).parent.resolve()))
    h.update(" ".join((torch.__version__, *paths, cpu.identity(), *CFLAGS, *ISA_CFLAGS[isa])).encode())
    return f"conveyor_{isa}_{cpu.flags_digest()}_{h.hexdigest()[:12]}"


# Builds the cache keeps, the most recently loaded (every edit of the sources adds one of each variant, ~2 MB):
# enough for the three variants of two checkouts or a source edit undone, and a bound on the folder.
KEPT_BUILDS = 8

_built: dict[str, Any] = {}  # isa -> its torch.ops namespace, or None if it failed (a library loads only once)
_active: dict[str, str] = {}  # "isa": the variant load() picked for the engine
_loaded_from: dict[str, str | None] = {}  # "cache_dir": where load() built it (narrow_ops builds beside it)


def build(isa: str, cache_dir: str | None) -> Any:
    """Build (or find built) and load variant `isa`; its torch.ops namespace, None if unavailable. Callers
    check missing(isa) first: loading is safe on any CPU, running a variant the CPU lacks is not."""
    if isa not in _built:
        _built[isa] = _build_and_load(isa, cache_dir)
    return _built[isa]


def load(cache_dir: str | None, isa: str = "auto") -> bool:
    """Build and load the variant for the setting `isa` for the engine; True when ops() is usable."""
    chosen = choose(isa)
    if build(chosen, cache_dir) is None:
        return False
    _active["isa"] = chosen
    _loaded_from["cache_dir"] = cache_dir
    return True


def narrow_ops() -> Any:
    """Beside a loaded avx512 variant, the avx2 one's kernels (None otherwise, or where it does not build): on
    the Xeon of docs/benchmarks.md its 256-bit GEMV streams the weights faster at one to a few rows (18.5 against
    19.7 ms over the model's weights at one row, 2026-12-02), so the GEMM plans measure both and keep the faster."""
    if _active.get("isa") != "avx512" or missing("avx2"):
        return None
    return build("avx2", _loaded_from.get("cache_dir"))


def active_isa() -> str | None:
    return _active.get("isa")


def vector_path() -> bool:
    """Whether the loaded variant has a vector path (not the portable loop)."""
    return _active.get("isa", "portable") != "portable"


def prefill_kernel_pays() -> bool:
    """Whether prefill attention should take the kernel: its vector builds run the products faster than torch's
    CPU flash kernel (docs/benchmarks.md: avx512 2.4-3.5x, avx2 1.05-1.7x), its portable loop 3-6x slower, so
    that one keeps torch's."""
    return vector_path()


def ops() -> Any:
    """The engine's kernels: torch.ops.conveyor_<isa> of the variant load() picked last."""
    return getattr(torch.ops, namespace(_active["isa"]))


def _build_and_load(isa: str, cache_dir: str | None) -> Any:
    name = build_name(isa)
    try:
        from torch.utils import cpp_extension

        root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "conveyor"
        build_dir = root / "kernels" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        # cpp_extension runs `ninja` by name; a worker started as .venv/bin/python may lack that bin on PATH
        with this_pythons_bin_on_path():
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=[*CFLAGS, *ISA_CFLAGS[isa], f"-DCONVEYOR_NS={namespace(isa)}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        found = getattr(torch.ops, namespace(isa))
        if not all(hasattr(found, op) for op in OPS):
            logger.warning("CPU kernels %s lack some of %s; paged attention gathers K/V in torch instead", name, OPS)
            return None
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the torch path
        logger.warning(
            "CPU kernels %s unavailable (%s: %s); paged attention gathers K/V in torch instead",
            isa,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None
    logger.info("CPU kernels loaded: %s (ISA %s, CPU %s)", name, isa, this_cpu().identity())
    try:
        prune_builds(build_dir.parent, name)
    except OSError as e:  # a cache folder this process may read but not change: the kernels still load
        logger.warning("CPU kernel builds not pruned in %s: %s", build_dir.parent, e)
    return found


def prune_builds(kernels: Path, loaded: str) -> None:
    """Mark the build just loaded as used now and remove the builds beyond the KEPT_BUILDS most recently used.
    A process running one removed keeps its mapped library; one starting on it builds it again."""
    os.utime(kernels / loaded)  # a build's folder time: when a process last loaded it
    aged = []
    for p in kernels.iterdir():
        if p.is_dir() and p.name.startswith("conveyor_"):
            try:
                aged.append((p.stat().st_mtime, p))
            except FileNotFoundError:  # removed by another process's pruning meanwhile
                continue
    builds = [p for _, p in sorted(aged, reverse=True)]
    for old in builds[KEPT_BUILDS:]:
        try:
            shutil.rmtree(old)
            logger.info("CPU kernels %s removed: not loaded since %d newer builds were", old.name, KEPT_BUILDS)
        except OSError as e:  # another process removing it too, or loading it meanwhile: it stays for a later start
            logger.warning("CPU kernels %s not removed: %s", old.name, e)
