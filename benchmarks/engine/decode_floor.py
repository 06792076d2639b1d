"""A single stream against this machine's memory-bandwidth floor (issue 29).

At one sequence a decode step reads every weight once (and the sequence's KV): at float32 that is ~0.5 GB
for SmolLM2-135M, so the step cannot be faster than bytes read / memory bandwidth. This measures, in one
process, side by side:

  bandwidth  the best of --reps passes of a read (torch.sum) over a --gib GiB float32 tensor, far larger than
             the caches, on torch's threads (what the engine's GEMVs run on); a copy (read + write) is shown too
  bytes      per decode step at the measured context: every parameter the forward reads (the LM head's tied
             weight once), plus the KV of every layer up to the position
  floor      bytes / read bandwidth
  as read    the same with each linear's weight counted as the copy its planned kernel reads at one row: a coded
             copy (gemm_kernels q4/q8: 4- or 8-bit codes of a weight that is exactly such blocks, the same float32
             values) is a sixth or a third of the float32 weight, so the engine's own floor is lower than float32's
  engine     the median of --steps engine.step() calls at one running sequence (greedy, ignore_eos), the
             worker's default EngineConfig: forward, sampling and the engine's bookkeeping; and, timed apart,
             the model forward alone (the runner's decode of the same step), so what a step spends outside the
             forward is its difference

Rounds interleave the bandwidth and the steps so drift hits both alike. Prints the ratios step / floor and
forward / floor; with --tpot-ms (a serving run's mean TPOT at c=1) also serving / floor.

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.decode_floor [--rounds 3] [--tpot-ms MS]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, stamp, write_json
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.cpu import gemm
from services.worker.engine.cpu.cpu_info import this_cpu
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)


def read_bandwidth(buf: torch.Tensor, reps: int) -> tuple[float, float]:
    """-> (read GB/s, copy GB/s counting read + write), best of reps each."""
    nbytes = buf.numel() * buf.element_size()
    dst = torch.empty_like(buf)
    best_read = best_copy = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(buf)
        best_copy = min(best_copy, time.perf_counter() - t)
    return nbytes / best_read / 1e9, 2 * nbytes / best_copy / 1e9


def step_bytes(engine: LLMEngine, context: int) -> tuple[int, int]:
    """-> (weight bytes, KV bytes) one decode step at `context` tokens reads."""
    model = engine.runner.model
    seen: set[int] = set()
    weights = 0
    for p in model.parameters():  # tied weights are one tensor: counted once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem * context
    # the embedding is read one row a step, not whole: only the LM head reads all of it (tied: same tensor)
    return weights, kv


def start_stream(engine: LLMEngine, prompt_len: int, seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    engine.add_request(
        EngineRequest(f"s{seed}", prompt, SamplingOptions(temperature=0, max_tokens=100_000, ignore_eos=True))
    )
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < prompt_len:
        engine.step()


def time_steps(engine: LLMEngine, n: int) -> tuple[list[float], list[float]]:
    """-> (wall of each engine.step(), the model forward's share of it, as the engine times it)."""
    walls, forwards = [], []
    for _ in range(n):
        t = time.perf_counter()
        r = engine.step()
        walls.append(time.perf_counter() - t)
        forwards.append(r.forward_time_s)
    return walls, forwards


def read_bytes(engine: LLMEngine, weights: int) -> int:
    """-> the weight bytes one decode step at one row reads as planned: each linear's weight as the copy its plan's
    kernel at one row reads (a coded copy's own size), the other parameters (norms) as they are."""
    linears = engine.runner.fused.linears()
    as_float32 = sum(lin.weight.nbytes for lin in {lin.weight.data_ptr(): lin for lin in linears}.values())
    read = weights - as_float32
    for lin in linears:
        plan = getattr(lin, "conveyor_gemm_plan", None)
        kernel = plan.kernel_for(1) if plan is not None else "linear"
        copy = getattr(lin, "conveyor_copies", {}).get(gemm.COPY_OF.get(kernel))
        read += copy.nbytes if kernel in gemm.SMALL_COPIES and copy is not None else lin.weight.nbytes
    return read


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--prompt", type=int, default=128, help="the stream's prompt tokens (its context)")
    ap.add_argument("--gib", type=float, default=2.0, help="size of the bandwidth test's tensor")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tpot-ms", type=float, default=None, help="a serving run's mean TPOT at c=1, to compare")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args()


def run_rounds(engine: LLMEngine, buf: torch.Tensor, args) -> tuple[list, list, list, list]:
    """-> (read GB/s, copy GB/s, step seconds, forward seconds): each round's bandwidths, then its steps."""
    reads, copies, steps, forwards = [], [], [], []
    for _ in range(args.rounds):
        r, c = read_bandwidth(buf, args.reps)
        reads.append(r)
        copies.append(c)
        w, f = time_steps(engine, args.steps)
        steps += w
        forwards += f
    return reads, copies, steps, forwards


def floor_result(engine: LLMEngine, tpot_ms: float | None, reads, copies, steps, forwards) -> dict:
    """The floors (float32, and as the planned kernels read the weights) and the step, forward and serving TPOT
    against them."""
    context = engine.scheduler.running[0].num_tokens
    weights, kv = step_bytes(engine, context)
    bw = max(reads)
    floor_ms = (weights + kv) / (bw * 1e9) * 1e3
    as_read = read_bytes(engine, weights)
    read_floor_ms = (as_read + kv) / (bw * 1e9) * 1e3
    step_ms, fwd_ms = statistics.median(steps) * 1e3, statistics.median(forwards) * 1e3
    return {
        "cpu": this_cpu(),
        "threads": torch.get_num_threads(),
        "read_gb_s": reads,
        "copy_gb_s": copies,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "context": context,
        "floor_ms": floor_ms,
        "step_ms_median": step_ms,
        "step_ms_min": min(steps) * 1e3,
        "forward_ms_median": fwd_ms,
        "step_over_floor": step_ms / floor_ms,
        "forward_over_floor": fwd_ms / floor_ms,
        "serving_tpot_ms": tpot_ms,
        "serving_over_floor": tpot_ms / floor_ms if tpot_ms else None,
        "weight_bytes_as_read": as_read,
        "floor_as_read_ms": read_floor_ms,
        "step_over_floor_as_read": step_ms / read_floor_ms,
        "serving_over_floor_as_read": tpot_ms / read_floor_ms if tpot_ms else None,
    }


def print_result(result: dict) -> None:
    reads, bw, context = result["read_gb_s"], max(result["read_gb_s"]), result["context"]
    weights, kv, as_read = result["weight_bytes"], result["kv_bytes"], result["weight_bytes_as_read"]
    floor_ms, read_floor_ms, tpot_ms = result["floor_ms"], result["floor_as_read_ms"], result["serving_tpot_ms"]
    step_ms, fwd_ms = result["step_ms_median"], result["forward_ms_median"]
    print(
        f"threads {result['threads']}, read {bw:.1f} GB/s (rounds {', '.join(f'{r:.1f}' for r in reads)}), "
        f"copy {max(result['copy_gb_s']):.1f} GB/s"
    )
    print(f"bytes per step at context {context}: weights {weights / 1e6:.1f} MB + KV {kv / 1e6:.1f} MB")
    print(
        f"floor {floor_ms:.1f} ms; engine step {step_ms:.1f} ms ({step_ms / floor_ms:.2f}x floor), "
        f"forward alone {fwd_ms:.1f} ms ({fwd_ms / floor_ms:.2f}x), outside the forward {step_ms - fwd_ms:.1f} ms"
    )
    print(
        f"as read by the planned kernels: weights {as_read / 1e6:.1f} MB, floor {read_floor_ms:.1f} ms; "
        f"engine step {step_ms / read_floor_ms:.2f}x that floor"
    )
    if tpot_ms:
        print(
            f"serving TPOT {tpot_ms:.1f} ms: {tpot_ms / floor_ms:.2f}x the float32 floor, "
            f"{tpot_ms / read_floor_ms:.2f}x the floor as read"
        )


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    s = CommonSettings()
    cfg = EngineConfig(tuning_cache_dir=str(s.cache_dir))
    engine = LLMEngine.from_model_dir(resolve_model_dir(s.model, s.cache_dir), cfg)
    buf = torch.ones(int(args.gib * (1 << 30)) // 4, dtype=torch.float32)
    start_stream(engine, args.prompt, 0)
    result = floor_result(engine, args.tpot_ms, *run_rounds(engine, buf, args))
    print_result(result)
    path = write_json(Path(args.out), "decode_floor", result, stamp())
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
