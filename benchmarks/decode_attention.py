"""Decode attention against memory bandwidth, by the order of a sequence's KV blocks in the pool (issue 29).

A decode step's attention reads every running sequence's K and V once; past a few hundred tokens of context at
c=32 that is tens of MB a layer, from DRAM (the pool of all layers is far larger than the caches). This measures,
in one process, the engine's paged decode kernel (csrc/paged_decode.cpp) over a pool of --layers layers with the
served model's geometry, each call on the next layer so that K/V come from memory as in the engine, with each
sequence's blocks laid out three ways:

  ascending   each sequence's blocks one run of consecutive blocks, in position order (what BlockManager.allocate
              hands out: its blocks sorted by address)
  descending  the same runs in reverse (what eviction after a tail-first release handed out before the sort)
  random      blocks anywhere (sequences that grew a block at a time while others did)

and, as the yardstick, a contiguous read of the whole pool (torch.sum over every layer's K and V). Prints GB/s
of K/V read per kernel call (median of --reps passes over the layers) and each order's ratio to the yardstick.

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.decode_attention [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, stamp, write_json
from services.worker.engine import cpu_ops
from services.worker.engine.cpu_info import this_cpu
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)

ORDERS = ("ascending", "descending", "random")


def tables_for(order: str, seqs: int, per_seq: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    if order == "random":
        return torch.stack([torch.randperm(blocks, generator=gen)[:per_seq] for _ in range(seqs)])
    runs = torch.arange(seqs * per_seq).view(seqs, per_seq)
    return runs if order == "ascending" else runs.flip(1)


def kernel_gb_s(ops, key, value, tables, context: int, reps: int) -> float:
    layers, heads = key.shape[0], 3 * key.shape[2]
    seqs, dim = tables.shape[0], key.shape[3]
    q = torch.randn(seqs, heads, dim)
    out = torch.empty_like(q)
    lens = torch.full((seqs,), context, dtype=torch.long)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for layer in range(layers):
            ops.paged_decode(out, q, key[layer], value[layer], tables, lens, 16, dim**-0.5, 0)
        times.append((time.perf_counter() - t) / layers)
    nbytes = 2 * seqs * context * key.shape[2] * dim * key.element_size()
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--cases", default="32x600,8x2100", help="sequences x context tokens, comma-separated")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ops = cpu_ops.build(cpu_ops.choose("auto"), str(CommonSettings().cache_dir))
    if ops is None:
        raise SystemExit("the CPU kernels did not build on this machine")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    bs, kvh, dim = 16, 3, 64  # SmolLM2-135M: 3 KV heads of 64, 16-token blocks (the worker's default)
    blocks = max(s * -(-ctx // bs) for s, ctx in cases) + 64
    key = torch.randn(args.layers, blocks * bs, kvh, dim)
    value = torch.randn(args.layers, blocks * bs, kvh, dim)
    gen = torch.Generator().manual_seed(0)
    found: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for seqs, ctx in cases:
            per_seq = -(-ctx // bs)
            for order in ORDERS:
                tables = tables_for(order, seqs, per_seq, blocks, gen)
                found.setdefault(f"{seqs}x{ctx} {order}", []).append(
                    kernel_gb_s(ops, key, value, tables, ctx, args.reps)
                )
            t = time.perf_counter()  # the yardstick: every layer's K and V read whole, in order, from DRAM
            key.sum()
            value.sum()
            found.setdefault(f"{seqs}x{ctx} contiguous read", []).append(
                2 * key.numel() * 4 / (time.perf_counter() - t) / 1e9
            )
    print(f"CPU {this_cpu().identity()}, kernels {cpu_ops.active_isa() or cpu_ops.choose('auto')}")
    for seqs, ctx in cases:
        base = statistics.median(found[f"{seqs}x{ctx} contiguous read"])
        print(f"{seqs} sequences x {ctx} tokens ({2 * seqs * ctx * kvh * dim * 4 / 1e6:.1f} MB a layer):")
        for order in ORDERS:
            gb = statistics.median(found[f"{seqs}x{ctx} {order}"])
            print(f"  {order:10s} {gb:5.1f} GB/s  ({gb / base:.2f} of a contiguous read's {base:.1f} GB/s)")
    result = {"cpu": this_cpu(), "threads": torch.get_num_threads(), "gb_s": found}
    path = write_json(Path(args.out), "decode_attention", result, stamp())
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
