"""Prefill attention: the engine's C++ kernel against torch's CPU flash kernel, side by side in one process (issue 29).

Two measurements, rounds interleaved so that drift hits both sides alike:

  kernel   one layer's attention for a chunk of --chunk tokens after 0, 512, ... cached tokens (the served model's
           geometry, K/V scattered over a paged pool): csrc/prefill_attention.cpp against what the engine ran
           before it (attention.py: torch's flash kernel, causal for a fresh chunk; for a chunk with context two
           passes, the context whole and the chunk causal, merged by their log-sum-exps); best of --reps each
  engine   a --prompt-token prompt (random ids, no prefix cache hit) prefilled by the worker's default engine,
           one timed engine.step() per chunk, with the runner's prefill kernel on and off in turn

Prints each side's time and the ratio torch / kernel (> 1: the kernel is faster).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.prefill_attention [--rounds 3]
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
from services.worker.engine.model import attention
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.model.attention import AttnGroup
from services.worker.engine.cpu.cpu_info import this_cpu
from services.worker.engine.kv.kv_cache import PagedKVCache
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernel_case(cache: PagedKVCache, heads: int, start: int, n: int, reps: int) -> dict:
    """One layer's attention of an n-token chunk after `start` cached tokens, both ways."""
    bs, kvh, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    blocks = -(-(start + n) // bs)
    table = torch.randperm(cache.num_blocks)[:blocks].view(1, blocks)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    spans = torch.tensor([[start, n]])
    group = AttnGroup(table, None, torch.zeros(1, 1), starts=(start,), lens=(n,), spans=spans)
    scale = d**-0.5

    def torch_path():
        if start:
            return attention._attend_chunks_with_context(q, k, v, group, cache, 0, scale)
        return attention._attend_causal(q[None], k[None], v[None], scale)

    ours = best_ms(lambda: attention._kernel(q, group, cache, 0, scale, None), reps)
    theirs = best_ms(torch_path, reps)
    flops = 4 * n * (start + (n + 1) / 2) * d * heads  # Q.K and P.V over the visible keys
    return {
        "start": start,
        "chunk": n,
        "kernel_ms": ours,
        "torch_ms": theirs,
        "kernel_gflops": flops / ours / 1e6,
        "torch_gflops": flops / theirs / 1e6,
    }


def prefill_steps(engine: LLMEngine, prompt_len: int, seed: int) -> list[float]:
    """Seconds of each engine.step() until a fresh prompt is prefilled (one request, nothing else running)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    engine.add_request(EngineRequest(f"p{seed}", prompt, SamplingOptions(temperature=0, max_tokens=1)))
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return steps[: -(-prompt_len // engine.config.max_num_batched_tokens)]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args()


def run_rounds(engine: LLMEngine, heads: int, starts: list[int], args) -> tuple[dict, dict]:
    """-> (the kernel cases of each start, the engine's chunk steps of each side), rounds interleaved; each round
    runs the engine's sides in the other order than the last."""
    runner = engine.runner
    cases: dict[int, list[dict]] = {st: [] for st in starts}
    engine_runs: dict[str, list[list[float]]] = {"kernel": [], "torch": []}
    for r in range(args.rounds):
        for st in starts:
            cases[st].append(kernel_case(runner.kv_cache, heads, st, args.chunk, args.reps))
        for side in ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel"):
            runner.prefill_kernel = side == "kernel"
            engine_runs[side].append(prefill_steps(engine, args.prompt, 1000 * r + (side == "kernel")))
    runner.prefill_kernel = True
    return cases, engine_runs


def kernel_report(cases: dict, chunk: int, head_dim: int, heads: int) -> list[dict]:
    """Prints each start's medians over the rounds; -> the rows of the result."""
    print("one layer's attention, chunk of", chunk, "tokens (best of reps, median over rounds):")
    kernel_rows = []
    for st in cases:
        k_ms = statistics.median(c["kernel_ms"] for c in cases[st])
        t_ms = statistics.median(c["torch_ms"] for c in cases[st])
        kernel_rows.append({"start": st, "kernel_ms": k_ms, "torch_ms": t_ms, "rounds": cases[st]})
        flops = 4 * chunk * (st + (chunk + 1) / 2) * head_dim * heads
        print(
            f"  after {st:5d} cached: kernel {k_ms:6.2f} ms ({flops / k_ms / 1e6:4.0f} GFLOPS), "
            f"torch {t_ms:6.2f} ms ({flops / t_ms / 1e6:4.0f}), torch / kernel {t_ms / k_ms:.2f}"
        )
    return kernel_rows


def engine_report(engine_runs: dict, prompt: int) -> dict[str, float]:
    """Prints each chunk step's medians over the rounds and the whole prompt's; -> each side's whole prompt."""
    med = {side: [statistics.median(col) for col in zip(*runs)] for side, runs in engine_runs.items()}
    print(f"engine, a {prompt}-token prompt, seconds per chunk step (median over rounds):")
    for i, (k, t) in enumerate(zip(med["kernel"], med["torch"])):
        print(f"  chunk {i + 1}: kernel {k:.3f} s, torch {t:.3f} s, torch / kernel {t / k:.2f}")
    total_k, total_t = sum(med["kernel"]), sum(med["torch"])
    print(f"  whole prompt: kernel {total_k:.3f} s, torch {total_t:.3f} s, torch / kernel {total_t / total_k:.2f}")
    return {"kernel": total_k, "torch": total_t}


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    s = CommonSettings()
    engine = LLMEngine.from_model_dir(
        resolve_model_dir(s.model, s.cache_dir), EngineConfig(tuning_cache_dir=str(s.cache_dir))
    )
    runner = engine.runner
    if not runner.prefill_kernel:
        raise SystemExit(f"the prefill kernel is off on this machine (CPU kernels: {cpu_ops.active_isa()})")
    heads = runner.model.config.num_attention_heads
    cases, engine_runs = run_rounds(engine, heads, [0, 512, 1024, 1536], args)
    print(f"CPU {this_cpu().identity()}, kernels {cpu_ops.active_isa()}, {torch.get_num_threads()} threads")
    kernel_rows = kernel_report(cases, args.chunk, runner.kv_cache.head_dim, heads)
    totals = engine_report(engine_runs, args.prompt)
    result = {
        "cpu": this_cpu(),
        "isa": cpu_ops.active_isa(),
        "threads": torch.get_num_threads(),
        "chunk": args.chunk,
        "prompt": args.prompt,
        "kernel": kernel_rows,
        "engine_steps_s": engine_runs,
        "engine_total_s": totals,
    }
    path = write_json(Path(args.out), "prefill_attention", result, stamp())
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
