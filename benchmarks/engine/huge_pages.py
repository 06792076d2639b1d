"""Transparent huge pages under the engine's memory (huge_pages.py): 4 KB pages against 2 MB ones, side by side.

Two measurements, each on 4 KB pages first and then, in the same process, after huge_pages.advise() has moved the
same memory into huge pages (MADV_COLLAPSE; skipped, saying so, where the kernel cannot):

  kernel   the paged decode attention kernel (csrc/paged_decode.cpp) over a pool of the served model's geometry
           (--pool-gib, random block tables), all layers, for a few (context, sequences) cases; best of --reps
  engine   the default engine, built with huge_pages=False, one greedy request decoding --tokens tokens: mean
           decode step (best of --rounds), then the same after advise()

Prints each side and the ratio 4 KB / 2 MB (> 1: huge pages are faster).
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.huge_pages
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, stamp, write_json
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.model import huge_pages
from services.worker.engine.cpu.cpu_info import this_cpu
from services.worker.engine.kv.kv_cache import kv_geometry
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

CASES = ((1500, 10), (2700, 8), (512, 32))


def kernel_ms(pool: tuple[torch.Tensor, torch.Tensor], geometry: tuple[int, int, int, int], reps: int) -> dict:
    key, value = pool
    layers, heads, kvh, d = geometry
    bs, slots = 16, key.shape[1]
    out = {}
    gen = torch.Generator().manual_seed(0)
    for ctx, n in CASES:
        blocks = -(-ctx // bs)
        table = torch.randperm(slots // bs, generator=gen)[: blocks * n].view(n, blocks).contiguous()
        q, lens = torch.randn(n, heads, d, generator=gen), torch.full((n,), ctx)
        res = torch.empty_like(q)
        op = cpu_ops.ops().paged_decode
        best = float("inf")
        for _ in range(reps + 1):
            t = time.perf_counter()
            for layer in range(layers):
                op(res, q, key[layer], value[layer], table, lens, bs, d**-0.5, 0)
            best = min(best, time.perf_counter() - t)
        out[f"{ctx}x{n}"] = {"ms": best * 1e3, "gb_s": ctx * n * layers * 2 * kvh * d * 4 / best / 1e9}
    return out


def decode_step_ms(engine: LLMEngine, tokens: int, rounds: int, tag: str) -> float:
    best = float("inf")
    for r in range(rounds):
        engine.add_request(EngineRequest(f"{tag}{r}", list(range(100, 164)), SamplingOptions(0.0, max_tokens=tokens)))
        engine.step()  # the prompt
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        best = min(best, (time.perf_counter() - t) / steps)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    s = CommonSettings()
    config = EngineConfig(tuning_cache_dir=str(s.cache_dir), huge_pages=False)
    engine = LLMEngine.from_model_dir(resolve_model_dir(s.model, s.cache_dir), config)
    cfg = engine.runner.model.config
    layers, kvh, d = kv_geometry(cfg)
    geometry = (layers, cfg.num_attention_heads, kvh, d)
    slots = int(args.pool_gib * 2**30) // (2 * geometry[0] * geometry[2] * geometry[3] * 4) // 16 * 16
    pool = tuple(torch.randn(geometry[0], slots, geometry[2], geometry[3]) for _ in range(2))
    small = {"kernel": kernel_ms(pool, geometry, args.reps), "step_ms": decode_step_ms(engine, args.tokens, 3, "a")}
    done = huge_pages.advise()
    if done is None or done.collapsed == 0:
        raise SystemExit("this kernel cannot collapse memory into huge pages (MADV_COLLAPSE, Linux 6.1+)")
    huge = {"kernel": kernel_ms(pool, geometry, args.reps), "step_ms": decode_step_ms(engine, args.tokens, 3, "b")}
    print(f"CPU {this_cpu().identity()}, kernels {cpu_ops.active_isa()}; {done.huge_bytes >> 20} MiB in huge pages")
    for case in small["kernel"]:
        a, b = small["kernel"][case], huge["kernel"][case]
        print(
            f"  decode attention {case:>8} (context x sequences): 4 KB {a['ms']:6.2f} ms ({a['gb_s']:4.1f} GB/s), "
            f"2 MB {b['ms']:6.2f} ms ({b['gb_s']:4.1f} GB/s), ratio {a['ms'] / b['ms']:.2f}"
        )
    print(
        f"  engine decode step, batch 1: 4 KB {small['step_ms']:.2f} ms, 2 MB {huge['step_ms']:.2f} ms, "
        f"ratio {small['step_ms'] / huge['step_ms']:.3f}"
    )
    result = {"cpu": this_cpu(), "isa": cpu_ops.active_isa(), "small": small, "huge": huge, "advised": vars(done)}
    path = write_json(Path(args.out), "huge_pages", result, stamp())
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
