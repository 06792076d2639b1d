"""The engine's throughput by torch thread count, alone and beside CPU hogs, one after the other in one run.

64 prompts of 32 tokens x 16 greedy tokens (ignore_eos) through the engine in process (`engine_throughput.run_engine`:
a warm-up engine first, the timed one cold), with torch on 2 then 1 thread; first with no hog, then beside --hogs
busy-loop processes (nice 0). Prints output tok/s and the mean step per case: on a contended machine a parallel
region waits for the thread a hog preempted, so fewer threads can do more (docs/benchmarks.md, "Overload").
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.engine_threads [--hogs 2]
"""

from __future__ import annotations

import argparse
import logging

import torch

from benchmarks.common import start_hogs, stop_hogs
from benchmarks.engine.engine_throughput import load, run_engine
from services.worker.engine import EngineConfig
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

logger = logging.getLogger(__name__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = load(resolve_model_dir("", CommonSettings().cache_dir))
    prompts = [[1 + (i * 7 + j) % 2000 for j in range(32)] for i in range(64)]
    for hogs_n in (0, args.hogs):
        hogs = start_hogs(hogs_n)
        try:
            for threads in (2, 1):
                torch.set_num_threads(threads)
                r = run_engine(model, prompts, 16, EngineConfig())
                logger.info(
                    "hogs=%d threads=%d: %.1f tok/s, mean step %.0f ms", hogs_n, threads, r["tok_s"], r["step_s"] * 1000
                )
        finally:
            stop_hogs(hogs)


if __name__ == "__main__":
    main()
