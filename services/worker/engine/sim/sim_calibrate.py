"""Measures the real engine's step costs and fits the simulator's timing model to them.

    python -m services.worker.engine.sim.sim_calibrate [--rounds 2]

Steps of known shape run on the torch engine (the configured model and device): single prefills of
P prompt tokens, and pure decode steps of B sequences over contexts of L tokens. Each shape's fastest
forward time over the rounds is kept (noise only slows a run down, and the first round also pays one-off
kernel selection for every new shape), and a least-squares fit (of relative errors) of

    step = overhead + prefill_s_per_token * P + decode_s_per_seq * B + decode_s_per_kv_token * KV

over all of them gives the CONVEYOR_SIM_* defaults (docs/simulated_engine.md). The result is one JSON
line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys

from services.worker.engine import EngineRequest, LLMEngine, SamplingOptions
from services.worker.build import engine_config
from shared.text.model_files import resolve_model_dir
from shared.process.runtime import setup_logging
from shared.settings import WorkerSettings

logger = logging.getLogger(__name__)

PREFILLS = (32, 128, 256, 512)
DECODES = ((1, 32), (8, 32), (32, 32), (8, 256))  # (sequences, context tokens)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 10_000) for _ in range(n)]


def _prefill_point(engine: LLMEngine, rng: random.Random, n: int) -> tuple[list[float], float]:
    engine.add_request(EngineRequest(f"p{rng.random()}", _prompt(rng, n), SamplingOptions(0.0, max_tokens=1)))
    result = engine.step()
    while engine.has_unfinished():
        engine.step()
    return [1.0, n, 0.0, 0.0], result.forward_time_s


def _decode_point(engine: LLMEngine, rng: random.Random, seqs: int, ctx: int) -> tuple[list[float], float]:
    opts = SamplingOptions(0.0, max_tokens=16, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(EngineRequest(f"d{i}-{rng.random()}", _prompt(rng, ctx), opts))
    best, kv = float("inf"), 0
    while engine.has_unfinished():
        running = engine.stats().num_running
        result = engine.step()
        if result.num_prefill_tokens == 0 and running == seqs and result.forward_time_s < best:
            best = result.forward_time_s
            kv = sum(engine.computed_tokens(o.request_id) or ctx for o in result.outputs)
    return [1.0, 0.0, seqs, kv], best


def measure(engine: LLMEngine, rounds: int) -> list[tuple[list[float], float]]:
    rng = random.Random(0)
    points: dict[str, tuple[list[float], float]] = {}
    for _ in range(rounds):
        shapes = [(f"p{n}", lambda n=n: _prefill_point(engine, rng, n)) for n in PREFILLS]
        shapes += [(f"d{b}x{c}", lambda b=b, c=c: _decode_point(engine, rng, b, c)) for b, c in DECODES]
        for key, run in shapes:
            row, t = run()
            if key not in points or t < points[key][1]:
                points[key] = (row, t)
            logger.info("%s: %.1f ms", key, t * 1e3)
    return list(points.values())


def fit(points: list[tuple[list[float], float]]) -> dict[str, float]:
    import numpy as np

    a = np.array([row for row, _ in points])
    b = np.array([t for _, t in points])
    # Relative error: a 50 ms decode step counts as much as a 1 s prefill, so the small steps shape the overhead.
    coef, *_ = np.linalg.lstsq(a / b[:, None], np.ones_like(b), rcond=None)
    names = ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq", "decode_s_per_kv_token")
    return {n: float(max(c, 0.0)) for n, c in zip(names, coef)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    s = WorkerSettings()
    setup_logging(s.log_level)
    cfg = engine_config(s)
    engine = LLMEngine.from_model_dir(resolve_model_dir(s.model, s.cache_dir), cfg)
    points = measure(engine, args.rounds)
    out = {"fit": fit(points), "points": [{"row": row, "forward_s": t} for row, t in points]}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
