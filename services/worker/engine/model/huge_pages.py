"""Transparent huge pages under the engine's big memory on CPU: the weights, their packed copies and the KV pool.

Why: a decode step reads every weight once and each sequence's K/V in 12 KB runs (one pool block's rows) that lie
anywhere in a 1 GiB pool. On 4 KB pages that is a page walk every few KB (the TLB covers a few MB of 4 KB pages,
GBs of 2 MB ones). Measured on the Xeon of docs/benchmarks.md (2026-12-02): the decode attention kernel over a
1 GiB pool read 16-16.3 GB/s on 4 KB pages and 17.9-19.1 GB/s on 2 MB ones (+11-17 %), and a batch-1 decode step
of the default model took 29.1 ms before and 28.0-28.1 ms after.

How: once the engine has allocated them (model_runner.for_model), every private anonymous read-write mapping of
the process of at least 2 MB (the heap included) is advised MADV_HUGEPAGE, so that later faults there take huge
pages in the THP "madvise" mode most distributions default to, and MADV_COLLAPSE (Linux 6.1+), so that what is
already there moves into huge pages now rather than in the minutes khugepaged would take. Why not only the
tensors' own ranges: oneDNN's packed weights are opaque tensors whose memory Python cannot see. Both are hints:
a kernel without them, THP set to "never", or any failure leaves the memory as it was, and says so in the log.

Cost: on bare metal a copy of the memory. On a VM whose balloon reports free memory to its host (virtio-balloon
free page reporting, as on the Xeon VM) the guest's free 2 MB blocks are exactly what it hands back, so every huge
page faults on the host: 5-13 ms per 2 MB, 11-26 s of a start there (2026-12-05). WorkerSettings.huge_pages turns
it off; at 32 sequences the huge pages under the weights, not only the pool's, made the step 1.08x faster.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@dataclass(frozen=True)
class Advised:
    regions: int  # mappings advised
    bytes: int  # their 2 MB-aligned bytes
    collapsed: int  # of the regions, those MADV_COLLAPSE moved into huge pages (all of it, or what it could)
    huge_bytes: int  # the process's AnonHugePages afterwards


def anon_regions(maps: str) -> list[tuple[int, int]]:
    """(start, end) of the private anonymous read-write mappings of at least HUGE bytes in /proc/<pid>/maps text."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) < 5 or not parts[1].startswith("rw") or not parts[1].endswith("p"):
            continue
        if len(parts) > 5 and parts[5] != "[heap]" and not parts[5].startswith("[anon:"):  # a file, the stack...
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo >= HUGE:
            out.append((lo, hi))
    return out


def huge_page_bytes() -> int:
    """The process's AnonHugePages, in bytes (0 where /proc says nothing)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def advise(ranges: list[tuple[int, int]] | None = None) -> Advised | None:
    """Advise (and collapse) `ranges` ((start, end) addresses), by default the process's big anonymous mappings;
    None where there is no /proc or madvise."""
    try:
        ranges = anon_regions(Path("/proc/self/maps").read_text()) if ranges is None else ranges
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError) as e:
        logger.info("transparent huge pages not advised: %s", e)
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    regions, total, collapsed, errors = 0, 0, 0, set()
    for lo, hi in ranges:
        start, end = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        if end <= start:
            continue
        regions, total = regions + 1, total + end - start
        for how in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if madvise(start, end - start, how) == 0:
                collapsed += how == MADV_COLLAPSE
            else:
                errors.add(f"{'collapse' if how == MADV_COLLAPSE else 'hugepage'}: {os.strerror(ctypes.get_errno())}")
    done = Advised(regions, total, collapsed, huge_page_bytes())
    logger.info(
        "transparent huge pages: %d mappings, %d MiB advised, %d collapsed; %d MiB in huge pages%s",
        done.regions,
        done.bytes >> 20,
        done.collapsed,
        done.huge_bytes >> 20,
        f" ({'; '.join(sorted(errors))})" if errors else "",
    )
    return done
