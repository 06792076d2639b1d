"""What the CPU is (model name, instruction-set flags) and how busy the rest of the machine keeps it.

Both keys of what is measured or built once per machine and kept in the cache directory (gemm.py's plans,
cpu_ops.py's kernel builds) name the CPU by cpu_identity(): the model name alone is not enough, since a VM
of one model name may expose different flags (a hypervisor masking AVX-512, a newer host), and a kernel
built for flags the CPU lacks dies on its first instruction. Only the instruction-set flags count, so
unrelated ones (hypervisor, tsc_known_freq, bug lists) do not invalidate every cache.

others_busy() is what makes a GEMM plan measured under another process's load recognisable: the machine's
busy CPU time (/proc/stat, steal included: a hypervisor's other guests) minus this process's own, over
the measured interval, as a share of all cores.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
PROC_STAT = Path("/proc/stat")

# /proc/cpuinfo flags that change which code may run or is fastest (x86 and Arm names); the rest are ignored.
_ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "bmi", "abm", "popcnt", "movbe", "lzcnt")
_ISA_PREFIXES += ("gfni", "vaes", "vpclmulqdq", "pclmulqdq", "aes", "sha", "adx", "asimd", "sve", "fp", "neon")


@dataclass(frozen=True)
class CpuInfo:
    name: str
    flags: frozenset[str]

    def isa_flags(self) -> tuple[str, ...]:
        return tuple(sorted(f for f in self.flags if f.startswith(_ISA_PREFIXES)))

    def identity(self) -> str:
        """The model name and a digest of its ISA flags: equal only for CPUs that run the same code alike."""
        return f"{self.name} [isa {self.flags_digest()}]"

    def flags_digest(self) -> str:
        return hashlib.sha256(" ".join(self.isa_flags()).encode()).hexdigest()[:10]


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's model name and flags (x86 "flags", Arm "Features")."""
    name, flags = "", frozenset()
    for line in text.splitlines():
        field, _, value = line.partition(":")
        field = field.strip()
        if field == "model name" and not name:
            name = value.strip()
        elif field in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(name or platform.processor() or platform.machine(), flags)


@functools.cache
def this_cpu() -> CpuInfo:
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError as e:
        logger.debug("no /proc/cpuinfo (%s)", e)
        return CpuInfo(platform.processor() or platform.machine(), frozenset())


@dataclass(frozen=True)
class CpuSample:
    """One reading: the machine's busy CPU seconds, this process's CPU seconds, the wall clock."""

    machine_busy_s: float
    own_s: float
    wall_s: float


def sample_cpu() -> CpuSample | None:
    """None where /proc/stat cannot be read (then nothing is judged loaded)."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError as e:
        logger.debug("no /proc/stat (%s)", e)
        return None
    # cpu user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    ticks = [int(v) for v in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    t = os.times()
    return CpuSample(busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic())


def others_busy(before: CpuSample | None, after: CpuSample | None, cores: int | None = None) -> float | None:
    """The share of all cores (0..1) other processes kept busy between the two samples; None if unknown."""
    if before is None or after is None or after.wall_s - before.wall_s <= 0:
        return None
    cores = cores or os.cpu_count() or 1
    others = (after.machine_busy_s - before.machine_busy_s) - (after.own_s - before.own_s)
    return min(1.0, max(0.0, others / (cores * (after.wall_s - before.wall_s))))


def others_busy_now(interval_s: float = 0.3) -> float | None:
    """others_busy over a short wait (this process idle meanwhile): is the machine quiet right now?"""
    before = sample_cpu()
    time.sleep(interval_s)  # a measurement interval, not a wait for an event: the load is averaged over it
    return others_busy(before, sample_cpu())
