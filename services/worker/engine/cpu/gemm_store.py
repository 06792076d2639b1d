"""Where measured GEMM plans are kept: in this process's memory and in one JSON file under the cache directory,
shared by the workers of a machine (written atomically, under a lock while one of them measures). A plan measured
under load is provisional (PlanEntry.provisional): gemm.py measures it again at a quiet start, up to MAX_TRIES."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from services.worker.engine.cpu.gemm_kernels import KERNELS

logger = logging.getLogger(__name__)

# v15: a held copy's kernels compete at every bucket without the margin (gemm._held); v14: 3 timed passes per bucket
# from 16 rows up, not 2 (gemm._REPS); v13: keys carry the kernels' variant and the libraries' ISA limits; v12: the
# kernels' source digest (cpu_ops.sources_digest: no more names bumped by hand at a kernel change); v11: avx512 panel
# tiles of 8 rows at 5-16 rows (v10: at all; v9: panel; v8: the *_near GEMVs; v7: gemv to 64 rows, gemv256; v5: keys
# name kernels)
PLAN_FILE = "gemm-plan-v15.json"
LOADED_SHARE = 0.25  # other processes busy on >= this share of the cores while measuring: the plan is provisional
MAX_TRIES = 3  # measurements of one plan at most (the first included) before a loaded one is kept anyway
# Plans the file keeps, the newest written: every change of the kernels' sources (or of the CPU, the threads, the
# model's shapes) keys new ones, and the file is read at every worker's start. A model is 5-10 keys.
MAX_PLANS = 256


@dataclass(frozen=True)
class PlanEntry:
    """A measured plan and how: others_busy, the share of the cores other processes used meanwhile (None:
    unknown, taken as quiet); tries, how many times this key has been measured."""

    kernels: tuple[str, ...]
    others_busy: float | None = None
    tries: int = 1

    @property
    def provisional(self) -> bool:
        """Measured under load, with tries left: to measure again once the machine is quiet."""
        return self.others_busy is not None and self.others_busy >= LOADED_SHARE and self.tries < MAX_TRIES


def needs_measuring(entry: PlanEntry | None, others_now: float | None) -> bool:
    """Measure (again) at this start? Yes without a plan; yes for a provisional one when the machine is quiet
    now (others_now: the share of the cores others use now; None, unknown: not quiet, keep the plan)."""
    if entry is None:
        return True
    return entry.provisional and others_now is not None and others_now < LOADED_SHARE


_memory: dict[str, PlanEntry] = {}  # this process's plans, by gemm.key()


class PlanStore:
    """Plans in memory, backed by one JSON file (written atomically; unreadable = measure again)."""

    def __init__(self, cache_dir: Path | str | None):
        self.path = Path(cache_dir) / PLAN_FILE if cache_dir else None
        self._disk: dict[str, PlanEntry] = {}
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            self._disk = {k: e for k, v in json.loads(self.path.read_text()).items() if (e := _entry(v)) is not None}
        except (OSError, ValueError, TypeError, AttributeError) as e:
            logger.warning("ignoring unreadable GEMM plan file %s: %s", self.path, e)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the plan file's lock (a no-op without a file), then see what others saved meanwhile."""
        if self.path is None:
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_suffix(".lock"), "a")
        except OSError as e:
            logger.warning("cannot lock %s (%s): measuring without the lock", self.path, e)
            yield
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            self._load()
            yield

    def get(self, k: str) -> PlanEntry | None:
        """The disk's entry wins over this process's memory: another process may have re-measured it."""
        if k in self._disk:
            _memory[k] = self._disk[k]
        return _memory.get(k)

    def put(self, k: str, entry: PlanEntry) -> None:
        """Keep entry for k, as the newest plan (the file drops the oldest beyond MAX_PLANS)."""
        _memory[k] = entry
        self._disk.pop(k, None)
        self._disk[k] = entry
        while len(self._disk) > MAX_PLANS:
            del self._disk[next(iter(self._disk))]

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gemm-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({k: _entry_json(e) for k, e in self._disk.items()}, f, indent=0)
            os.replace(tmp, self.path)  # atomic: concurrent workers never read half a file
        except OSError as e:
            logger.warning("cannot save the GEMM plan to %s (it will be measured again next start): %s", self.path, e)


def _entry(v: object) -> PlanEntry | None:
    """A file entry read back; None for anything malformed (that key is measured again)."""
    if not isinstance(v, dict):
        return None
    kernels, busy, tries = v.get("kernels"), v.get("others_busy"), v.get("tries")
    if not (isinstance(kernels, list) and kernels and all(n in KERNELS for n in kernels)):
        return None
    if not (busy is None or isinstance(busy, (int, float))) or not (isinstance(tries, int) and tries >= 1):
        return None
    return PlanEntry(tuple(kernels), busy, tries)


def _entry_json(e: PlanEntry) -> dict:
    return {"kernels": list(e.kernels), "others_busy": e.others_busy, "tries": e.tries}
