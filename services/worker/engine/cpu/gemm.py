"""Tuned GEMM kernels for the model's linear layers on CPU.

`y = x @ W.T` has several equal formulations (gemm_kernels.py) that run at very different speeds for the skinny
products of batched decoding (M = 8..128 rows against a 576x1536 or 49152x576 weight). Measured on a 2-core
EPYC, the LM head at M=32 takes 39 ms as `linear`, 27 ms `flipped`, 22 ms `onednn` and ~10 ms `packed`; at M=1
`linear` wins. So the choice is measured, not guessed: once per (weight shape, dtype,
thread count, torch build, CPU model and ISA flags: cpu_info.py) and per power-of-two bucket of M, at engine
start, over passes through the model's layers in order (see measure); then kept in memory and in a JSON file
under the cache directory, so a restarted worker does not measure again.

A plan measured while other processes kept the machine busy (cpu_info.others_busy over the measurement, >=
LOADED_SHARE of the cores) is kept but provisional: their load skews the timings (a kernel that streams memory
suffers more than one that computes), so a later start that finds the machine quiet measures it again, up to
MAX_TRIES measurements in all; after that the last one is kept, load or not (a machine that is never quiet still
gets a plan, and starts stay bounded).

How it is applied (apply_plan): each nn.Linear keeps its type, weights and ties (the LM head still shares the
embedding's storage); only its `forward` is overridden, on the instance. A layer whose plan uses `packed` or `panel(8)`
for some M also holds that kernel's copy of the weight (gemm_kernels.COPIES: memory for speed, on CPU only).
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.cpu.cpu_info import others_busy, others_busy_now, sample_cpu, this_cpu
from services.worker.engine.cpu.gemm_kernels import (  # noqa: F401 - the kernels' names, re-exported for callers
    COPIES,
    COPY_OF,
    FAR_LINES,
    GEMV_MAX_ROWS,
    KERNEL_CODES,
    KERNELS,
    MAX_ROWS,
    NEAR_MAX_ROWS,
    SMALL_COPIES,
    copy_for,
    offered,
)
from services.worker.engine.cpu.gemm_store import (  # noqa: F401 - the store's names, re-exported for callers
    LOADED_SHARE,
    MAX_TRIES,
    PLAN_FILE,
    PlanEntry,
    PlanStore,
    needs_measuring,
)
from shared.settings import library_isa_limits

logger = logging.getLogger(__name__)

# Timed passes per kernel and bucket (after one warm-up); the fastest is kept (noise only adds time). Three: on the
# 2-core Zen 3 of docs/benchmarks.md a quiet pass strays up to +60 % from its kernel's median in slow seconds that
# span rounds, and from 16 rows up the fastest of 2 passes picked a kernel >= 5 % slower than the best in 0.9-1.3
# of the 30 choices of a measurement, of 3 passes in 0.35-0.5 (resampled from 10-pass runs), for ~12 s more at
# start. More at a few rows, where a pass takes ~20-30 ms and the kernels lie within a few % of each other.
_REPS = 3
_REPS_FEW_ROWS = (8, 6)  # (up to this many rows, this many passes)
# Another kernel must be >= 10 % faster than `linear` to be chosen (the safe default; a packed kernel also holds a
# copy of the weight); the engine's own GEMV, which holds nothing more and is checked against F.linear in the
# tests, >= 3 % (the plans' timing noise): at one row it draws 5-15 % more of the memory's bandwidth than MKL.
_MARGIN = dict.fromkeys(("gemv", "gemv256", "gemv_near", "gemv256_near"), 0.97)
_DEFAULT_MARGIN = 0.9


@dataclass(frozen=True)
class Plan:
    """Which kernel to use for M rows: kernels[i] covers M in (2**(i-1), 2**i] (the last: all beyond)."""

    kernels: tuple[str, ...]

    def kernel_for(self, m: int) -> str:
        i = max(0, (m - 1).bit_length())  # ceil(log2(m)); m=1 -> 0
        return self.kernels[min(i, len(self.kernels) - 1)]


def key(out_features: int, in_features: int, dtype: torch.dtype, buckets: int, kernels: tuple[str, ...]) -> str:
    cpu = this_cpu().identity()  # the model name and a digest of its ISA flags: another CPU measures its own
    # and the code that runs on it: the kernels' sources (an older build is measured again), the variant loaded
    # (cpu_isa may force avx2 on an AVX-512 CPU) and the libraries' ISA limits
    code = (cpu_ops.sources_digest(), cpu_ops.active_isa(), *library_isa_limits())
    fields = (cpu, *code, torch.__version__, torch.get_num_threads(), dtype, out_features, in_features, buckets)
    return "|".join(map(str, (*fields, "+".join(kernels))))


def _usable(name: str, x: torch.Tensor, w: torch.Tensor, copy: torch.Tensor | None) -> bool:
    """A kernel is a candidate only if it runs here and agrees with F.linear."""
    if name in COPY_OF and copy is None:
        return False
    try:
        return torch.allclose(KERNELS[name](x, w, None, copy), F.linear(x, w), rtol=1e-3, atol=1e-3)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # op missing in this torch build / dtype
        logger.info("GEMM kernel %s unavailable for %s %s: %s", name, tuple(w.shape), w.dtype, e)
        return False


@torch.inference_mode()
def measure(targets: list[tuple[nn.Linear, str, int]], kernels: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The fastest kernel per plan key for M = 1, 2, 4, ... 2**(buckets-1) rows.

    Timed as the engine runs them: whole passes over every target layer in forward order, so each
    weight comes in from memory as it does in a step (a model's weights outgrow the caches; timing one
    weight in a loop keeps it cached and favours the kernels that stream memory worst). Per bucket: one
    warm-up pass per kernel (the library's per-shape setup), then passes interleaved across kernels
    (so drift hits all alike); a key's time is its layers' summed time in its fastest pass.
    """
    kinds = {COPY_OF[n] for n in kernels if n in COPY_OF}
    copies = {id(m): {c: _try_copy(c, m) for c in kinds} for m, _, _ in targets}
    names: dict[str, list[str]] = {}  # per plan key, the kernels usable for every layer of it (a coded copy is a
    for m, k, _ in targets:  # property of each weight's values, not of its shape)
        probe = torch.randn(3, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
        mine = copies[id(m)]
        names[k] = [
            n for n in names.get(k, kernels) if n == "linear" or _usable(n, probe, m.weight, mine.get(COPY_OF.get(n)))
        ]
    fast: dict[str, list[dict[str, float]]] = {k: [] for k in names}  # per bucket: kernel -> time / linear's
    for i in range(max(b for _, _, b in targets)):
        live = [(m, k) for m, k, b in targets if i < b]
        xs = {
            m.in_features: torch.randn(2**i, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
            for m, _ in live
        }
        best: dict[tuple[str, str], float] = {}
        here = [n for n in kernels if 2**i <= MAX_ROWS.get(n, 2**i)]
        reps = _REPS_FEW_ROWS[1] if 2**i <= _REPS_FEW_ROWS[0] else _REPS
        for rep in range(1 + reps):
            for n in here:
                sums = _timed_pass(n, live, names, xs, copies)
                for k, v in sums.items():
                    if rep:
                        best[(k, n)] = min(best.get((k, n), float("inf")), v)
        for k in {k for _, k in live}:
            bar = best[(k, "linear")]
            fast[k].append({n: best[(k, n)] / bar for n in names[k] if n in here and n != "linear"})
    return {k: _one_copy(v) for k, v in fast.items()}


def _one_copy(buckets: list[dict[str, float]]) -> tuple[str, ...]:
    """The plan from each bucket's kernels over their bars (time relative to linear's), holding at most one float32
    copy of the weight (COPIES: memory within twice the weights) and a small one (SMALL_COPIES): of the plans each
    set of copies allows (a kernel where it beats linear by its margin), the one with the least summed relative
    time; on a tie, the fewest copies. Then, at every bucket, the kernels of the copies it holds compete without a
    margin: the copy is paid for (_held)."""
    options = []
    for big in (None, *(c for c in COPIES if c not in SMALL_COPIES)):
        for small in (None, *SMALL_COPIES):
            kinds = {c for c in (big, small) if c is not None}
            plan = [_fastest(b, lambda n, t: COPY_OF.get(n) in kinds | {None} and t < _margin(n)) for b in buckets]
            options.append((sum(t for t, _ in plan), len(kinds), tuple(n for _, n in plan)))
    return _held(buckets, min(options)[2])


def _margin(name: str) -> float:
    return _MARGIN.get(name, _DEFAULT_MARGIN)


def _fastest(bucket: dict[str, float], allowed) -> tuple[float, str]:
    """(time relative to linear's, kernel): the fastest of linear and the bucket's kernels allowed(name, time)."""
    return min([(1.0, "linear"), *((t, n) for n, t in bucket.items() if allowed(n, t))])


def _held(buckets: list[dict[str, float]], plan: tuple[str, ...]) -> tuple[str, ...]:
    """plan with each bucket's kernel the fastest of linear, those that beat it by their margin and any kernel of a
    copy the plan holds. Why: the margin guards against holding a copy for a lead within the timing noise; where
    the copy is held for other buckets that doubt is spent, and a bar measured fast by luck (linear's fastest of
    three passes) must not send a bucket to F.linear: on the Zen 4 of docs/benchmarks.md (2026-12-07) two
    measurements of three left one or three of the four layer shapes on F.linear at 512 rows (nothing under 0.9
    of its bar there), and a 512-token prefill step with F.linear on all four took 852 ms against 622 on the panel
    GEMM whose copy every plan held (medians of 8)."""
    held = {COPY_OF[n] for n in plan if n in COPY_OF}
    return tuple(
        _fastest(b, lambda n, t: COPY_OF.get(n) in held or (n not in COPY_OF and t < _margin(n)))[1] for b in buckets
    )


def _timed_pass(
    name: str,
    live: list[tuple[nn.Linear, str]],
    names: dict[str, list[str]],
    xs: dict[int, torch.Tensor],
    copies: dict[int, dict[str, torch.Tensor | None]],
) -> dict[str, float]:
    sums: dict[str, float] = {}
    for m, k in live:
        if name not in names[k]:
            continue
        t = time.perf_counter()
        KERNELS[name](xs[m.in_features], m.weight, None, copies[id(m)].get(COPY_OF.get(name)))
        sums[k] = sums.get(k, 0.0) + time.perf_counter() - t
    return sums


def _try_copy(name: str, module: nn.Linear) -> torch.Tensor | None:
    """The copy of kind `name` of the weight; None where it cannot be made (then its kernels are no candidates)."""
    try:
        return copy_for(name, module)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # no oneDNN / CPU kernels here, or the dtype
        w = module.weight  # a weight that is not coded is the rule, not news (tune_linears counts the coded ones)
        log = logger.debug if name in SMALL_COPIES else logger.info
        log("GEMM weight copy for %s unavailable for %s %s: %s", name, tuple(w.shape), w.dtype, e)
        return None


def _planned_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] with the kernel planned for this many rows."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    name = self.conveyor_gemm_plan.kernel_for(x2.shape[0])
    if name == "linear":
        return F.linear(x, self.weight, self.bias)
    y = KERNELS[name](x2, self.weight, self.bias, self.conveyor_copies.get(COPY_OF.get(name)))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def apply_plan(module: nn.Linear, plan: Plan) -> None:
    """Run `module` by `plan` from now on (the weight copies its kernels read made here: gemm_kernels.COPIES)."""
    module.conveyor_gemm_plan = plan
    kinds = {COPY_OF[n] for n in plan.kernels if n in COPY_OF}  # panel and panel8 share one copy
    module.conveyor_copies = {c: copy_for(c, module) for c in sorted(kinds)}
    module.__dict__.pop("conveyor_coded", None)  # coded copies made to key the plan: kept only where it takes them
    module.forward = types.MethodType(_planned_forward, module)


def tune_linears(
    layers: list[nn.Linear],
    head: nn.Linear | None,
    max_rows: int,
    max_head_rows: int,
    cache_dir: Path | str | None,
    gemv: bool = False,
) -> int:
    """Give each of `layers` (plain nn.Linear) a measured kernel plan; returns how many use more than `linear`.

    max_rows: the step's token budget (a prompt's last chunk may overshoot it by a sixteenth: Plan.kernel_for
    runs those rows with the top bucket's kernel); max_head_rows: most rows
    of the output head `head` (the sequences sampled in one step: only those rows reach it); gemv: offer the
    engine's own kernel (the caller loaded the CPU kernels with a vector path).
    """
    kernels = offered(gemv)
    targets: list[tuple[nn.Linear, str, int]] = []  # (layer, plan key, buckets)
    for module in layers:
        rows = max_head_rows if module is head else max_rows
        buckets = max(1, (max(1, rows) - 1).bit_length() + 1)
        mine = tuple(n for n in kernels if n not in SMALL_COPIES or _try_copy(n, module) is not None)
        k = key(module.out_features, module.in_features, module.weight.dtype, buckets, mine)
        targets.append((module, k, buckets))
    store = PlanStore(cache_dir)
    _measure_needed(store, targets, kernels)
    mixed, copy_bytes = 0, 0
    for module, k, _ in targets:
        plan = store.get(k).kernels
        apply_plan(module, Plan(plan))
        copy_bytes += sum(
            t.nbytes if c in SMALL_COPIES else module.weight.nbytes for c, t in module.conveyor_copies.items()
        )
        mixed += any(n != "linear" for n in plan)
    read_coded = sum(1 for m, _, _ in targets if set(m.conveyor_copies) & set(SMALL_COPIES))
    logger.info(  # how many read their weight as codes: 0 for a model whose weights are not coded blocks
        "GEMM plans: %d of %d layers use a faster kernel than F.linear somewhere, %d read as codes; weight copies "
        "%.1f MiB",
        mixed,
        len(targets),
        read_coded,
        copy_bytes / 2**20,
    )
    return mixed


CODED_MAX_ROWS = 32  # the most rows an unmeasured plan runs on a weight's codes


def unmeasured_plans(layers: list[nn.Linear]) -> int:
    """Plans without measuring (gemm_tuning off): a layer whose weight is coded blocks (coded.py) runs on its codes
    (q4, else q8) up to CODED_MAX_ROWS rows, where a step is bound by reading the weight and the codes are a sixth
    or a third of its bytes, and F.linear beyond; any other layer keeps F.linear. The 20 plans measured for the
    bundled model on the Xeon of docs/benchmarks.md (its avx512 and avx2 builds, two threads) chose the codes at 1-16
    rows in all, at 32 in 16 (a float32 panel or packed copy, memory of its own, in the others). Returns how many
    layers run so."""
    coded = 0
    for module in layers:
        name = next((n for n in SMALL_COPIES if _try_copy(n, module) is not None), None)
        if name is None:
            module.__dict__.pop("conveyor_coded", None)  # what the tries left: none of them is a copy
            continue
        buckets = CODED_MAX_ROWS.bit_length() + 1  # 1, 2, 4 ... 32 rows, then all beyond
        apply_plan(module, Plan((name,) * (buckets - 1) + ("linear",)))
        coded += 1
    logger.info(
        "GEMM plans not measured: %d of %d layers read their weight as codes up to %d rows, F.linear beyond",
        coded,
        len(layers),
        CODED_MAX_ROWS,
    )
    return coded


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's nn.Linear layers that tuning may take over (subclasses, e.g. quantized, keep their forward)."""
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.dim() == 2]


def _measure_needed(store: PlanStore, targets: list[tuple[nn.Linear, str, int]], kernels: tuple[str, ...]) -> None:
    """Measure the plans not known yet, and the provisional ones if the machine is quiet now; one process at
    a time: workers starting together would otherwise time their kernels against each other."""
    seen = {k: store.get(k) for _, k, _ in targets}
    others_now = others_busy_now() if any(e is not None and e.provisional for e in seen.values()) else None
    todo = {k for k, e in seen.items() if needs_measuring(e, others_now)}
    if not todo:
        return
    t0, measured, provisional, busy = time.perf_counter(), 0, 0, None
    with store.exclusive():
        todo = {k for k in todo if store.get(k) == seen[k]}  # what another process measured meanwhile is kept
        if todo:
            before = sample_cpu()
            plans = measure([t for t in targets if t[1] in todo], kernels)
            busy = others_busy(before, sample_cpu())
            for k, plan in plans.items():
                entry = PlanEntry(plan, busy, seen[k].tries + 1 if seen[k] else 1)
                store.put(k, entry)
                measured += 1
                provisional += entry.provisional
            store.save()
    logger.info(
        "GEMM kernels measured for %d weight shapes in %.1f s (other processes busy on %s of the cores; "
        "%d plans provisional: measured again at a quiet start)",
        measured,
        time.perf_counter() - t0,
        "?" if busy is None else f"{busy:.0%}",
        provisional,
    )
