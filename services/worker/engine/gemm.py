"""Tuned GEMM kernels for the model's linear layers on CPU.

`y = x @ W.T` has several equal formulations that run at very different speeds for the skinny
products of batched decoding (M = 8..128 rows against a 576x1536 or 49152x576 weight):
  linear   F.linear (MKL sgemm, the weight as the transposed operand)
  flipped  (W @ x.T).T: the same products and sums, the other operand order, another kernel
  onednn   oneDNN's linear (the primitive torch.compile's CPU backend uses)
Measured on a 2-core EPYC, the LM head at M=32 takes 39 ms as `linear`, 27 ms `flipped` and 22 ms
`onednn`; the MLP projections differ by ~10 %; at other sizes `linear` wins. So the choice is
measured, not guessed: once per (weight shape, dtype, thread count, torch build, CPU) and per
power-of-two bucket of M, at engine start, min of interleaved runs; then kept in memory and in a
JSON file under the cache directory, so a restarted worker does not measure again.

How it is applied: each nn.Linear keeps its type, weights and ties (the LM head still shares the
embedding's storage); only its `forward` is overridden, on the instance.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import platform
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PLAN_FILE = "gemm-plan-v2.json"
_REPS = 3  # fewest timed runs per variant (after one warm-up); the minimum is kept (noise only adds time)
_MARGIN = 0.9  # another kernel must be >= 10 % faster than `linear` to be chosen (the safe default)
_memory: dict[str, tuple[str, ...]] = {}  # this process's plans, by key()


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _flipped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(w, x.t()).t().contiguous()  # [N, K] @ [K, M] -> [N, M] -> [M, N]
    return y if b is None else y + b


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


KERNELS = {"linear": _linear, "flipped": _flipped, "onednn": _onednn}  # x [M, K], w [N, K] -> [M, N]


@dataclass(frozen=True)
class Plan:
    """Which kernel to use for M rows: kernels[i] covers M in (2**(i-1), 2**i] (the last: all beyond)."""

    kernels: tuple[str, ...]

    def kernel_for(self, m: int) -> str:
        i = max(0, (m - 1).bit_length())  # ceil(log2(m)); m=1 -> 0
        return self.kernels[min(i, len(self.kernels) - 1)]


@functools.cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError as e:
        logger.debug("no /proc/cpuinfo (%s)", e)
    return platform.processor() or platform.machine()


def key(out_features: int, in_features: int, dtype: torch.dtype, buckets: int) -> str:
    return "|".join(map(str, (_cpu_name(), torch.__version__, torch.get_num_threads(), dtype, out_features,
                              in_features, buckets)))


def _usable(name: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    """A kernel is a candidate only if it runs here and agrees with F.linear."""
    try:
        return torch.allclose(KERNELS[name](x, w, None), F.linear(x, w), rtol=1e-3, atol=1e-3)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # op missing in this torch build / dtype
        logger.info("GEMM kernel %s unavailable for %s %s: %s", name, tuple(w.shape), w.dtype, e)
        return False


def _fastest(x: torch.Tensor, w: torch.Tensor, names: list[str]) -> str:
    """Interleaved timed runs (so drift hits all alike), min of each; enough runs for ~10 ms each."""
    t0 = time.perf_counter()
    for name in names:  # warm (allocator, the library's per-shape setup)
        KERNELS[name](x, w, None)
    reps = max(_REPS, min(200, int(0.01 * len(names) / max(time.perf_counter() - t0, 1e-6))))
    best = dict.fromkeys(names, float("inf"))
    for _ in range(reps):
        for name in names:
            t = time.perf_counter()
            KERNELS[name](x, w, None)
            best[name] = min(best[name], time.perf_counter() - t)
    winner = min(best, key=best.get)
    return winner if best[winner] < _MARGIN * best["linear"] else "linear"


@torch.inference_mode()
def measure(weight: torch.Tensor, buckets: int) -> tuple[str, ...]:
    """The fastest kernel for M = 1, 2, 4, ... 2**(buckets-1) rows against `weight` [N, K]."""
    probe = torch.randn(3, weight.shape[1], dtype=weight.dtype, device=weight.device)
    names = [n for n in KERNELS if n == "linear" or _usable(n, probe, weight)]
    choice = []
    for i in range(buckets):
        x = torch.randn(2 ** i, weight.shape[1], dtype=weight.dtype, device=weight.device)
        choice.append(_fastest(x, weight, names))
    return tuple(choice)


class PlanStore:
    """Plans in memory, backed by one JSON file (written atomically; unreadable = measure again)."""

    def __init__(self, cache_dir: Path | str | None):
        self.path = Path(cache_dir) / PLAN_FILE if cache_dir else None
        self._disk: dict[str, list[str]] = {}
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            self._disk = {k: v for k, v in json.loads(self.path.read_text()).items()
                          if isinstance(v, list) and v and all(n in KERNELS for n in v)}
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

    def get(self, k: str) -> tuple[str, ...] | None:
        if k in _memory:
            return _memory[k]
        if k in self._disk:
            _memory[k] = tuple(self._disk[k])
            return _memory[k]
        return None

    def put(self, k: str, plan: tuple[str, ...]) -> None:
        _memory[k] = plan
        self._disk[k] = list(plan)

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gemm-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(self._disk, f, indent=0)
            os.replace(tmp, self.path)  # atomic: concurrent workers never read half a file
        except OSError as e:
            logger.warning("cannot save the GEMM plan to %s (it will be measured again next start): %s",
                           self.path, e)


def _planned_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] with the kernel planned for this many rows."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    name = self.conveyor_gemm_plan.kernel_for(x2.shape[0])
    if name == "linear":
        return F.linear(x, self.weight, self.bias)
    y = KERNELS[name](x2, self.weight, self.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def tune_linears(model: nn.Module, max_rows: int, max_head_rows: int, cache_dir: Path | str | None) -> int:
    """Give every nn.Linear of `model` a measured kernel plan; returns how many use more than `linear`.

    max_rows: most rows a layer sees in one step (the step's token budget); max_head_rows: most rows
    of the output head (the sequences sampled in one step; transformers keeps only those rows).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets: list[tuple[nn.Linear, str, int]] = []  # (layer, plan key, buckets)
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dim() != 2:
            continue  # subclasses (quantized layers, ...) keep their own forward
        rows = max_head_rows if module is head else max_rows
        buckets = max(1, (max(1, rows) - 1).bit_length() + 1)
        targets.append((module, key(module.out_features, module.in_features, module.weight.dtype, buckets), buckets))
    store = PlanStore(cache_dir)
    missing = {k: (m, b) for m, k, b in targets if store.get(k) is None}
    if missing:
        _measure_missing(store, missing)
    mixed = 0
    for module, k, _ in targets:
        plan = store.get(k)
        module.conveyor_gemm_plan = Plan(plan)
        module.forward = types.MethodType(_planned_forward, module)
        mixed += any(n != "linear" for n in plan)
    return mixed


def _measure_missing(store: PlanStore, missing: dict[str, tuple[nn.Linear, int]]) -> None:
    """Measure the plans not known yet, one process at a time: workers starting together would
    otherwise time their kernels against each other and keep skewed plans."""
    t0, measured = time.perf_counter(), 0
    with store.exclusive():
        for k, (module, buckets) in missing.items():
            if store.get(k) is None:  # another process may have measured it while this one waited
                store.put(k, measure(module.weight.detach(), buckets))
                measured += 1
        if measured:
            store.save()
    logger.info("GEMM kernels measured for %d weight shapes in %.1f s", measured, time.perf_counter() - t0)
