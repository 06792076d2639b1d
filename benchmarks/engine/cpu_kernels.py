"""The engine's C++ CPU kernels per ISA variant (portable, avx2, avx512: cpu_ops.py), side by side in one process.

Each kernel at SmolLM2-135M's shapes (9 query heads, 3 KV heads, head dim 64, hidden 576, MLP 1536,
vocabulary 49,152), for 1 and 8 sequences: paged decode attention over a context of --context tokens in
16-token blocks scattered over the pool, the per-layer ops (add + RMSNorm, rotary, SiLU * up) and the
sampler's draw. Calls are timed in interleaved rounds across the variants (so drift and the other
processes of a shared machine hit all alike); the median per call is reported, and the share of the cores
other processes used meanwhile (cpu_info.others_busy), since on a shared machine that is the noise floor.
A variant this CPU lacks is reported as such, not run.

Run: .venv/bin/python -m benchmarks.engine.cpu_kernels [--context 512] [--rounds 30] [--rows 1,8] [--threads N] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.cpu.cpu_info import others_busy, sample_cpu, this_cpu
from shared.settings import CPU_ISAS, CommonSettings

HEADS, KV_HEADS, DIM, HIDDEN, MLP, VOCAB, BLOCK = 9, 3, 64, 576, 1536, 49152, 16


def cases(s: int, context: int) -> dict[str, Callable[[Any], None]]:
    """Kernel name -> a call of it on ops (one variant's namespace) for s sequences / rows."""
    g = torch.Generator().manual_seed(s)
    per_seq = -(-context // BLOCK)
    blocks = s * per_seq + 8
    key = torch.randn(blocks * BLOCK, KV_HEADS, DIM, generator=g)
    value = torch.randn(blocks * BLOCK, KV_HEADS, DIM, generator=g)
    tables = torch.randperm(blocks, generator=g)[: s * per_seq].view(s, per_seq)
    lens = torch.full((s,), context, dtype=torch.long)
    q, out = torch.randn(s, HEADS, DIM, generator=g), torch.empty(s, HEADS, DIM)
    h, x, w, normed = torch.randn(s, HIDDEN), torch.randn(s, HIDDEN), torch.randn(HIDDEN), torch.empty(s, HIDDEN)
    qk = torch.randn(s, HEADS + KV_HEADS, DIM)
    angle = torch.rand(s, DIM, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()  # a rotation: repeated calls keep the values' scale
    gate_up, act = torch.randn(s, 2 * MLP), torch.empty(s, MLP)
    logits, inv_temp, u = torch.randn(s, VOCAB), torch.ones(s), torch.rand(s, generator=g)
    return {
        f"paged_decode ctx {context}": lambda o: o.paged_decode(out, q, key, value, tables, lens, BLOCK, DIM**-0.5, 0),
        "add_rms_norm": lambda o: o.add_rms_norm(normed, h, x, w, 1e-5),
        "rotary": lambda o: o.rotary(qk, cos, sin),
        "silu_mul": lambda o: o.silu_mul(act, gate_up),
        "sample_rows": lambda o: o.sample_rows(logits, inv_temp, u),
    }


def timed(fn: Callable[[Any], None], ops: Any, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn(ops)
    return (time.perf_counter() - t) / reps


def run(variants: dict[str, Any], s: int, context: int, rounds: int) -> dict[tuple[str, str], float]:
    """(kernel, isa) -> median seconds per call."""
    samples: dict[tuple[str, str], list[float]] = {}
    for name, fn in cases(s, context).items():
        reps = max(1, int(2e-3 / max(timed(fn, next(iter(variants.values())), 3), 1e-7)))  # ~2 ms a sample
        for ops in variants.values():
            timed(fn, ops, reps)  # warm-up
        for _ in range(rounds):
            for isa, ops in variants.items():
                samples.setdefault((name, isa), []).append(timed(fn, ops, reps))
    return {k: statistics.median(v) for k, v in samples.items()}


def table(results: dict[int, dict[tuple[str, str], float]], isas: list[str]) -> str:
    head = "| kernel | rows | " + " | ".join(f"{i} (us)" for i in isas) + " | avx2 / portable | avx512 / avx2 |"
    lines = [head, "|" + "---|" * (len(isas) + 4)]
    for s, res in results.items():
        for name in dict.fromkeys(k for k, _ in res):
            us = {i: res[(name, i)] * 1e6 for i in isas}
            ratio = {
                pair: f"{us[pair[0]] / us[pair[1]]:.2f}" if all(p in us for p in pair) else "-"
                for pair in (("avx2", "portable"), ("avx512", "avx2"))
            }
            cells = " | ".join(f"{us[i]:.1f}" for i in isas)
            lines.append(f"| {name} | {s} | {cells} | {ratio[('avx2', 'portable')]} | {ratio[('avx512', 'avx2')]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--rows", default="1,8", help="sequences / rows per call, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, the cores)")
    ap.add_argument("--cache-dir", default=str(CommonSettings().cache_dir))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = this_cpu()
    variants = {}
    for isa in CPU_ISAS:
        if cpu_ops.missing(isa):
            print(f"{isa}: this CPU lacks {','.join(sorted(cpu_ops.missing(isa)))}, not run")
        elif (ops := cpu_ops.build(isa, args.cache_dir)) is not None:
            variants[isa] = ops
    isas = [i for i in reversed(CPU_ISAS) if i in variants]  # portable first
    before = sample_cpu()
    results = {int(s): run(variants, int(s), args.context, args.rounds) for s in args.rows.split(",")}
    busy = others_busy(before, sample_cpu())
    print(f"CPU: {cpu.identity()}; torch threads {torch.get_num_threads()}; {args.rounds} rounds, median per call")
    print(f"other processes busy on {'?' if busy is None else f'{busy:.0%}'} of the cores meanwhile")
    print(table(results, isas))


if __name__ == "__main__":
    main()
