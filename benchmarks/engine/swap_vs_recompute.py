"""A paused session's KV: recompute it, or swap it to the disk tier and back? Timed per conversation length.

The real default model on the torch engine, with the worker's default EngineConfig (1 GiB KV pool on CPU,
512-token steps, so a long prefill runs in chunks as it would in the worker). For each length, each repetition:

  recompute    prefill of the whole conversation through LLMEngine (max_tokens=1: add_request to its token)
  swap-out     DiskTier.put_parts(runner.read_slabs(the conversation's blocks)): the worker's path, one layer's
               slab at a time through a reused buffer; beside it the whole payload gathered into a fresh array
               (runner.read_blocks) + DiskTier.put, what the worker did before (2026-12-02)
  swap-in      DiskTier.get (the checksum included) + runner.write_blocks into other, free blocks
  swap-in cold the same, after the file's pages are written back and dropped from the page cache
               (posix_fadvise on that file only): the read then comes from the disk

Every repetition's conversation starts with a token of its own, so no prefix-cache hit shortens a recompute. The
swapped-in blocks are compared with the originals (torch.equal) once per length. The model's context window is
8,192 tokens and a request must leave room for one generated token, so the longest conversation is 8,191.
Prints medians and the ratio swap-in / recompute; writes docs/results/swap_vs_recompute-STAMP.json.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.swap_vs_recompute [--reps 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import ROOT, print_table, write_json
from benchmarks.engine.engine_throughput import load
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.kv.kv_tier import DiskTier
from shared.wire.block_hash import block_hashes
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)

SIZES = (512, 2048, 8192)
KEY = "session"
STEPS = ("put_parts", "read_blocks", "put", "get", "write_blocks", "get_cold", "write_blocks_cold")


def conversation(tokens: int, rep: int, vocab: int) -> list[int]:
    """Deterministic token ids; the first is the repetition's own, so no two repetitions share a block hash."""
    rng = np.random.default_rng(tokens * 1000 + rep)
    return [100 + rep] + rng.integers(1000, vocab, tokens - 1).tolist()


def recompute(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    """Seconds from add_request to the conversation's first generated token (the whole prefill)."""
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=1)))
    while engine.has_unfinished():
        for out in engine.step().outputs:
            assert out.error_reason is None, out.error
    return time.perf_counter() - t0


def conversation_blocks(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """The blocks a paused session of this conversation would hold: its full blocks (found in the prefix cache,
    where the finished request left them) and one more for its partial last block, when it has one."""
    bs = engine.blocks.block_size
    hashes = list(block_hashes(prompt, bs))
    blocks = engine.blocks.lookup_prefix(hashes, len(hashes))
    assert len(blocks) == len(hashes), "the conversation's full blocks are cached"
    if len(prompt) % bs:
        blocks = blocks + engine.blocks.allocate(1)  # stands for the partial block, released by the caller
    return blocks


def drop_page_cache(path: Path) -> None:
    """Write the file back and drop its pages (this file's only: the machine is shared)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def swap_out(runner, tier: DiskTier, blocks: list[int], t: dict[str, float]) -> None:
    """Both ways (the whole payload first, then the slabs, whose entry is the one kept)."""
    t0 = time.perf_counter()
    payload = runner.read_blocks(blocks)
    t1 = time.perf_counter()
    stored = tier.put(KEY, [], payload)
    t["read_blocks"], t["put"] = t1 - t0, time.perf_counter() - t1
    del payload
    t0 = time.perf_counter()
    stored = stored and tier.put_parts(KEY, [], len(blocks) * runner.block_bytes, runner.read_slabs(blocks))
    t["put_parts"] = time.perf_counter() - t0
    assert stored, f"the tier's bound ({tier.max_bytes} bytes) is too small"


def swap_in(runner, tier: DiskTier, targets: list[int], t: dict[str, float], suffix: str) -> None:
    t0 = time.perf_counter()
    swapped = tier.get(KEY)
    t1 = time.perf_counter()
    assert swapped is not None, "the entry reads back"
    runner.write_blocks(targets, swapped.payload)
    t["get" + suffix], t["write_blocks" + suffix] = t1 - t0, time.perf_counter() - t1


def swap_cycle(engine: LLMEngine, tier: DiskTier, blocks: list[int], check: bool) -> tuple[dict[str, float], int]:
    """Swap the blocks out and back in twice (page cache warm, then cold) -> (seconds of each step, file bytes)."""
    runner, t = engine.runner, {}
    swap_out(runner, tier, blocks, t)
    file_bytes = tier.bytes_used
    targets = engine.blocks.allocate(len(blocks))
    try:
        swap_in(runner, tier, targets, t, "")
        drop_page_cache(next(tier.directory.glob("*.kv")))
        swap_in(runner, tier, targets, t, "_cold")
        if check:
            kv = runner.kv_cache
            assert torch.equal(kv.key[:, targets], kv.key[:, blocks]), "K swapped in equals K swapped out"
            assert torch.equal(kv.value[:, targets], kv.value[:, blocks]), "V swapped in equals V swapped out"
    finally:
        engine.blocks.release(targets)
        tier.drop(KEY)
    return t, file_bytes


def measure(engine: LLMEngine, tier: DiskTier, tokens: int, reps: int) -> dict:
    vocab = engine.vocab_size
    tokens = min(tokens, engine.max_len - 1)  # room for the one generated token
    runs = []
    for rep in range(reps):
        prompt = conversation(tokens, rep, vocab)
        recompute_s = recompute(engine, prompt, f"c{tokens}-{rep}")
        blocks = conversation_blocks(engine, prompt)
        try:
            steps, file_bytes = swap_cycle(engine, tier, blocks, check=rep == 0)
        finally:
            if len(prompt) % engine.blocks.block_size:
                engine.blocks.release(blocks[-1:])
        runs.append({"recompute": recompute_s, **steps})
        logger.info("%d tokens, rep %d: %s", tokens, rep, {k: round(v, 4) for k, v in runs[-1].items()})
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    swap_in, swap_in_cold = med["get"] + med["write_blocks"], med["get_cold"] + med["write_blocks_cold"]
    return {
        "tokens": tokens,
        "blocks": len(blocks),
        "payload_bytes": len(blocks) * engine.runner.block_bytes,
        "file_bytes": file_bytes,
        "median_s": med,
        "swap_out_s": med["put_parts"],
        "swap_out_whole_payload_s": med["read_blocks"] + med["put"],
        "swap_in_s": swap_in,
        "swap_in_cold_s": swap_in_cold,
        "ratio_swap_in_to_recompute": swap_in / med["recompute"],
        "ratio_swap_in_cold_to_recompute": swap_in_cold / med["recompute"],
        "runs": runs,
    }


def warm_up(engine: LLMEngine) -> None:
    """One short request first: the first forward pass pays one-off costs no repetition should."""
    recompute(engine, conversation(64, 99, engine.vocab_size), "warm-up")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        logger.warning("lscpu failed; reporting platform.processor()", exc_info=True)
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def report(results: list[dict]) -> None:
    rows = [
        [
            r["tokens"],
            r["blocks"],
            f"{r['payload_bytes'] / 2**20:.1f} MiB",
            f"{r['median_s']['recompute'] * 1000:.0f}",
            f"{r['swap_out_s'] * 1000:.1f}",
            f"{r['swap_in_s'] * 1000:.1f}",
            f"{r['swap_in_cold_s'] * 1000:.1f}",
            f"{r['ratio_swap_in_to_recompute']:.4f}",
            f"{r['ratio_swap_in_cold_to_recompute']:.4f}",
        ]
        for r in results
    ]
    headers = ["tokens", "blocks", "KV", "recompute ms", "swap-out ms", "swap-in ms", "swap-in cold ms"]
    print_table(headers + ["in/re", "cold/re"], rows)
    print()
    steps = [[r["tokens"]] + [f"{r['median_s'][s] * 1000:.1f}" for s in STEPS] for r in results]
    print_table(["tokens"] + [f"{s} ms" for s in STEPS], steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cache_dir = CommonSettings().cache_dir
    config = EngineConfig(tuning_cache_dir=str(cache_dir))  # the worker's defaults; its GEMM plan on disk
    engine = LLMEngine.from_model(load(resolve_model_dir("", cache_dir)), config)
    warm_up(engine)
    tier_dir = Path(cache_dir) / f"kv-tier-bench-{os.getpid()}"
    t0, load_start = time.time(), os.getloadavg()
    try:
        with DiskTier(tier_dir, 4 << 30) as tier:
            results = [measure(engine, tier, n, args.reps) for n in args.sizes]
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    report(results)
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "dtype": str(engine.runner.kv_cache.key.dtype),
        "block_bytes": engine.runner.block_bytes,
        "engine_config": {
            "kv_cache_bytes": config.kv_cache_bytes,
            "max_num_batched_tokens": config.max_num_batched_tokens,
        },
        "context_window": engine.model_max_len,
        "tier_parent_dir": str(Path(cache_dir).resolve()),
        "reps": args.reps,
    }
    path = write_json(args.out, "swap_vs_recompute", {"meta": meta, "results": results})
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
