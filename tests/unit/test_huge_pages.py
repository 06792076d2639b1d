"""The engine's memory on transparent huge pages: which mappings are advised, and a real collapse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.model import huge_pages

MAPS = """\
55d0c0000000-55d0c1000000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0004000000 rw-p 00000000 00:00 0 
7f0004000000-7f0004100000 rw-p 00000000 00:00 0 
7f0008000000-7f0008400000 rw-p 00000000 00:00 0                          [anon:glibc malloc]
7f0010000000-7f0014000000 r--p 00000000 00:00 0 
7f0020000000-7f0024000000 rw-s 00000000 00:05 1234                       /dev/shm/x
7f0030000000-7f0034000000 rw-p 00000000 fd:01 99                         /usr/lib/libtorch.so
7ffc00000000-7ffc00800000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_anonymous_writable_mappings_of_2_mb_or_more_are_taken():
    assert huge_pages.anon_regions(MAPS) == [
        (0x55D0C0000000, 0x55D0C1000000),
        (0x7F0000000000, 0x7F0004000000),
        (0x7F0008000000, 0x7F0008400000),  # an anonymous mapping with a name (prctl PR_SET_VMA_ANON_NAME)
    ]


def region_huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings over t's memory (/proc/self/smaps; an advised range is a mapping of its own)."""
    ptr, end = t.data_ptr(), t.data_ptr() + t.nbytes
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and ptr < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_touched_tensor_is_moved_into_huge_pages():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel has transparent huge pages off")
    t = torch.ones(16 << 20)  # 64 MB, every page touched on 4 KB pages (or huge ones in THP "always" mode)
    if region_huge_bytes(t) >= 32 << 20:
        pytest.skip("THP is 'always' here: the tensor is on huge pages already, nothing to observe")
    # Its own range only: the whole process (an xdist worker's, models loaded) took 28.7 s of the suite on a VM
    # with free page reporting (2026-12-05).
    done = huge_pages.advise([(t.data_ptr(), t.data_ptr() + t.nbytes)])
    if done is None or done.collapsed == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+)")
    assert region_huge_bytes(t) >= 32 << 20
    assert torch.all(t == 1), "the contents move with the pages"


def test_the_huge_pages_setting_reaches_the_engine():
    from services.worker.build import engine_config
    from shared.settings import WorkerSettings

    assert engine_config(WorkerSettings(huge_pages=False)).huge_pages is False
    assert engine_config(WorkerSettings()).huge_pages is True
