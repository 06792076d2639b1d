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
With --baseline REV the kernels as they were at git revision REV are built too (same flags, a namespace of their
own) and measured in the same rounds, interleaved: each row then gives both and their ratio.

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.decode_attention [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, ROOT, stamp, write_json
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.cpu.cpu_info import this_cpu
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)

ORDERS = ("ascending", "descending", "random")
BLOCK, KV_HEADS, HEAD_DIM = 16, 3, 64  # SmolLM2-135M: 3 KV heads of 64, 16-token blocks (the worker's default)


def tables_for(order: str, seqs: int, per_seq: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    if order == "random":
        return torch.stack([torch.randperm(blocks, generator=gen)[:per_seq] for _ in range(seqs)])
    runs = torch.arange(seqs * per_seq).view(seqs, per_seq)
    return runs if order == "ascending" else runs.flip(1)


_SPILL: list[torch.Tensor] = []


def flush_caches() -> None:
    """Read 512 MB that is not the pool, so that a pass finds no K/V in the caches: a small case's pool (1 x 2,048
    tokens: 94 MB over 30 layers) fits a server's L3, and whichever kernel ran second found it warm."""
    if not _SPILL:
        _SPILL.append(torch.ones(128 * 2**20))
    _SPILL[0].sum()


def batch_lens(case: str) -> torch.Tensor:
    """Context lengths of a case: "32x200" 32 sequences of 200 tokens; "16x300+16x100" 16 of 300, then 16 of 100."""
    groups = [tuple(int(x) for x in part.split("x")) for part in case.split("+")]
    return torch.tensor([ctx for seqs, ctx in groups for _ in range(seqs)], dtype=torch.long)


def kernel_gb_s(ops, key, value, tables, lens: torch.Tensor, reps: int) -> float:
    layers, heads = key.shape[0], 3 * key.shape[2]
    seqs, dim = tables.shape[0], key.shape[3]
    q = torch.randn(seqs, heads, dim)
    out = torch.empty_like(q)
    times = []
    for _ in range(reps):
        flush_caches()
        t = time.perf_counter()
        for layer in range(layers):
            ops.paged_decode(out, q, key[layer], value[layer], tables, lens, 16, dim**-0.5, 0)
        times.append((time.perf_counter() - t) / layers)
    nbytes = 2 * int(lens.sum()) * key.shape[2] * dim * key.element_size()
    return nbytes / statistics.median(times) / 1e9


def build_baseline(rev: str, isa: str):
    """The CPU kernels of git revision `rev` (its csrc folder), built for `isa` under the namespace
    conveyor_baseline; its torch.ops namespace."""
    from torch.utils import cpp_extension

    csrc = cpu_ops.CSRC.relative_to(ROOT)
    folder = Path(tempfile.mkdtemp(prefix="conveyor-baseline-"))
    tar = subprocess.run(["git", "archive", rev, str(csrc)], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tar, check=True)
    cpp_extension.load(
        name=f"conveyor_baseline_{isa}",
        sources=[str(folder / csrc / "kernels.cpp")],
        extra_cflags=[*cpu_ops.CFLAGS, *cpu_ops.ISA_CFLAGS[isa], "-DCONVEYOR_NS=conveyor_baseline"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return torch.ops.conveyor_baseline


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument(
        "--cases",
        default="32x200,32x600,8x2100,16x300+16x100,1x2048",
        help="sequences x context tokens, comma-separated; a+b: a batch of both (16x300+16x100: the 16 longest first)",
    )
    ap.add_argument("--baseline", help="a git revision whose kernels to measure beside this tree's")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args()


def kernels_to_measure(baseline: str | None) -> tuple[str, dict]:
    """-> (the ISA, the kernels by name: this tree's, and with a baseline revision its own)."""
    isa = cpu_ops.choose("auto")
    ops = cpu_ops.build(isa, str(CommonSettings().cache_dir))
    if ops is None:
        raise SystemExit("the CPU kernels did not build on this machine")
    kernels = {"this tree": ops}
    if baseline:
        kernels[f"at {baseline}"] = build_baseline(baseline, isa)
    return isa, kernels


def run_rounds(cases: dict, kernels: dict, args) -> dict[str, list[float]]:
    """GB/s of each case, order and kernel, and of the yardstick, per round."""
    blocks = max(len(lens) * -(-int(lens.max()) // BLOCK) for lens in cases.values()) + 64
    key = torch.randn(args.layers, blocks * BLOCK, KV_HEADS, HEAD_DIM)
    value = torch.randn(args.layers, blocks * BLOCK, KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    found: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for case, lens in cases.items():
            per_seq = -(-int(lens.max()) // BLOCK)
            for order in ORDERS:
                tables = tables_for(order, len(lens), per_seq, blocks, gen)
                for name, k in kernels.items():
                    found.setdefault(f"{case} {order} {name}", []).append(
                        kernel_gb_s(k, key, value, tables, lens, args.reps)
                    )
            t = time.perf_counter()  # the yardstick: every layer's K and V read whole, in order, from DRAM
            key.sum()
            value.sum()
            found.setdefault(f"{case} contiguous read", []).append(
                2 * key.numel() * 4 / (time.perf_counter() - t) / 1e9
            )
    return found


def print_found(cases: dict, kernels: dict, found: dict, baseline: str | None) -> None:
    for case, lens in cases.items():
        base = statistics.median(found[f"{case} contiguous read"])
        print(f"{case} (sequences x tokens; {2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 4 / 1e6:.1f} MB a layer):")
        for order in ORDERS:
            gb = {name: statistics.median(found[f"{case} {order} {name}"]) for name in kernels}
            line = "  ".join(f"{name} {v:5.1f} GB/s ({v / base:.2f} of a read)" for name, v in gb.items())
            if baseline:
                line += f"  ratio {gb['this tree'] / gb[f'at {baseline}']:.2f}"
            print(f"  {order:10s} {line}")
        print(f"  (a contiguous read of the pool: {base:.1f} GB/s)")


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    isa, kernels = kernels_to_measure(args.baseline)
    cases = {c: batch_lens(c) for c in args.cases.split(",")}
    found = run_rounds(cases, kernels, args)
    print(f"CPU {this_cpu().identity()}, kernels {isa}")
    print_found(cases, kernels, found, args.baseline)
    result = {"cpu": this_cpu(), "threads": torch.get_num_threads(), "baseline": args.baseline, "gb_s": found}
    path = write_json(Path(args.out), "decode_attention", result, stamp())
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
