"""Where a step's time goes, and what each engine lever buys, measured side by side in one process.

Engine variants (EngineConfig switches) are built on their own model instances, each holding 32 running
sequences (random 128-token prompts, greedy, ignore_eos); their batch-32 decode steps are timed in interleaved
rounds (so drift hits all alike), at a context of ~200 tokens. Each variant also times a 512-token prefill
(one prompt, one step; --prefill N tokens instead). With --profile, torch.profiler's table of the chosen variant's decode step and prefill.

Run: .venv/bin/python -m benchmarks.engine.engine_profile [--variants base,fused,kernel,all] [--profile all] [--batch 32]
  The GEMV kernel at a few sequences: --variants all,no-gemv --batch 4
  A step's layers in one C++ call or op by op from Python: --variants all,no-stack --batch 1
  A decode step in runs of sequences, one a thread, or whole: --variants all,no-split --batch 32
  The last layer past its attention on the logits rows only or on every row: --variants all,all-rows --rounds 6
  The panel GEMM's 8-row tiles past 16 rows (where the plans chose them) or not: --variants all,no-panel8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.cpu import gemm
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings, WorkerSettings

# name -> EngineConfig switches; "all" is the default configuration
VARIANTS = {
    "base": dict(fused_model=False, cpu_kernels=False, gemm_tuning=False),
    "tuned": dict(fused_model=False, cpu_kernels=False),
    "fused": dict(cpu_kernels=False),
    "kernel": dict(fused_model=False),
    "all": {},
    "no-gemv": dict(gemv_kernel=False),  # the GEMM plans without the engine's own GEMV kernel
    "no-stack": dict(layer_stack=False),  # the layers op by op from Python (no csrc/layer_stack.cpp)
    "no-split": dict(decode_split_rows=0),  # a decode step's stack whole, each op split between the threads
    "all-rows": {},  # the default, with the last layer on every row of a step (_every_row)
    "no-panel8": {},  # the default, its GEMM plans without the panel GEMM's 8-row tiles past 16 rows (_no_panel8)
}


def _every_row(engine: LLMEngine) -> None:
    """The last layer past its attention on every row of a step, as before it ran on the logits rows only (a
    prefill chunk's other rows are read by nothing after it): the engine's forward asked for all rows' hidden
    states, the logits rows then picked from them."""
    fused = engine.runner.fused
    hidden = fused.hidden

    def every(input_ids, positions, meta, rows):
        return hidden(input_ids, positions, meta, torch.arange(input_ids.shape[0]))[rows]

    fused.hidden = every


def _no_panel8(engine: LLMEngine) -> None:
    """The GEMM plans with panel's tiles where they chose panel8's (8 rows at any row count: gemm_kernels), on the
    same panel copies: what the plans gave before panel8 was offered."""
    fused = engine.runner.fused
    for linear in fused.linears():
        plan = getattr(linear, "conveyor_gemm_plan", None)
        if plan is not None and "panel8" in plan.kernels:
            gemm.apply_plan(linear, gemm.Plan(tuple("panel" if k == "panel8" else k for k in plan.kernels)))
    fused._stack, fused._stack_codes = None, {}  # the layer stack's cached copies and kernel codes


# variants that are the default engine changed after it is built
PATCHES = {"all-rows": _every_row, "no-panel8": _no_panel8}


def build(name: str, cache_dir: str, dtype: str) -> LLMEngine:
    s = WorkerSettings()  # CONVEYOR_CPU_ISA=avx2 (say) profiles that build of the kernels
    cfg = EngineConfig(
        enable_prefix_caching=False, tuning_cache_dir=cache_dir, dtype=dtype, cpu_isa=s.cpu_isa, **VARIANTS[name]
    )
    engine = LLMEngine.from_model_dir(resolve_model_dir(s.model, s.cache_dir), cfg)
    if name in PATCHES:
        PATCHES[name](engine)
    return engine


def fill(engine: LLMEngine, n: int, prompt_len: int, seed: int) -> None:
    """n sequences decoding (their prompts computed), each with room for many more tokens."""
    rng = random.Random(seed)
    for i in range(n):
        engine.add_request(
            EngineRequest(
                f"d{seed}-{i}",
                [rng.randrange(100, 40000) for _ in range(prompt_len)],
                SamplingOptions(temperature=0, max_tokens=4000, ignore_eos=True),
            )
        )
    while len(engine.scheduler.running) < n or any(
        s.num_computed_tokens < prompt_len for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(64):  # context ~ prompt + 64
        engine.step()


def time_steps(engine: LLMEngine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t)
    return out


def time_prefill(engine: LLMEngine, tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    engine.add_request(
        EngineRequest(
            f"p{seed}", [rng.randrange(100, 40000) for _ in range(tokens)], SamplingOptions(temperature=0, max_tokens=1)
        )
    )
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def profile_table(fn, rows: int = 18) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="base,tuned,fused,kernel,all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per variant per round")
    ap.add_argument("--profile", default=None, help="print torch.profiler tables for this variant")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding in the timed steps")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the timed (and profiled) prefill")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice); "
        "1 is steadier on a shared machine (no thread waits for a descheduled peer)",
    )
    return ap.parse_args()


def measure(engines: dict, args) -> tuple[dict, dict]:
    """Each variant's prefill times (on idle engines, one step each; round 0 warms up), then its decode steps at
    args.batch sequences, variants taking turns each round."""
    decode = {n: [] for n in engines}
    prefill = {n: [] for n in engines}
    for r in range(args.rounds + 1):
        for n, e in engines.items():
            t = time_prefill(e, args.prefill, 1000 + r)
            if r:
                prefill[n].append(t)
    for i, e in enumerate(engines.values()):
        fill(e, args.batch, 128, i)
    for _ in range(args.rounds):
        for n, e in engines.items():
            decode[n] += time_steps(e, args.steps)
    return decode, prefill


def report(decode: dict, prefill: dict, args) -> None:
    names = list(decode)
    base = statistics.median(decode[names[0]])
    print(
        f"threads {torch.get_num_threads()}; batch-{args.batch} decode step (ctx ~200) and {args.prefill}-token "
        "prefill, ms"
    )
    print(f"{'variant':8} {'decode min':>10} {'median':>8} {'x ' + names[0]:>9} {'prefill min':>11} {'median':>8}")
    for n in names:
        d, p = decode[n], prefill[n]
        print(
            f"{n:8} {min(d) * 1e3:10.1f} {statistics.median(d) * 1e3:8.1f} {base / statistics.median(d):9.2f} "
            f"{min(p) * 1e3:11.1f} {statistics.median(p) * 1e3:8.1f}"
        )


def print_profiles(name: str, e, args) -> None:
    print(f"\n[{name}] 3 decode steps at batch {args.batch}\n" + profile_table(lambda: time_steps(e, 3)))
    for seq in list(e.scheduler.running):
        e.abort_request(seq.request_id)
    e.step()
    print(f"\n[{name}] one {args.prefill}-token prefill\n" + profile_table(lambda: time_prefill(e, args.prefill, 7)))


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache_dir = str(CommonSettings().cache_dir)
    engines = {n: build(n, cache_dir, args.dtype) for n in args.variants.split(",")}
    report(*measure(engines, args), args)
    if args.profile:
        print_profiles(args.profile, engines[args.profile], args)


if __name__ == "__main__":
    main()
