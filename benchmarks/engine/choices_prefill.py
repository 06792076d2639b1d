"""What computing an n > 1 request's prompt once buys, on the real engine in one process.

The n choices of one request (one prompt, sampled, seeds 0..n-1) are run to completion on the default engine,
once as a group (the engine holds the other choices until the first has computed the prompt, then they reuse its
blocks) and once as n unrelated requests arriving together (each computes the prompt). Reported per run: prompt
tokens computed (the engine's prefill token count), time to the last choice's first token, and total time.
Both runs start from an empty prefix cache (a fresh engine on the same model).

Run: .venv/bin/python -m benchmarks.engine.choices_prefill [--n 8] [--prompt 1000] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import random
import time

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings


def run(engine: LLMEngine, prompt: list[int], n: int, max_tokens: int, group: str) -> dict:
    for i in range(n):
        engine.add_request(
            EngineRequest(
                f"{group or 'alone'}-{i}",
                prompt,
                SamplingOptions(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True),
                group_id=group,
            )
        )
    t0, first, prefill = time.perf_counter(), {}, 0
    while engine.has_unfinished():
        result = engine.step()
        prefill += result.num_prefill_tokens
        for out in result.outputs:
            first.setdefault(out.request_id, time.perf_counter() - t0)
    return {
        "prefill_tokens": prefill,
        "last_first_token_s": round(max(first.values()), 3),
        "total_s": round(time.perf_counter() - t0, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    s = CommonSettings()
    model_dir = resolve_model_dir(s.model, s.cache_dir)
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(a.prompt)]
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(tuning_cache_dir=s.cache_dir))
    run(engine, prompt[:64], 1, 2, "")  # warm-up (kernels, allocator), on another prompt
    for label, group in (("group", "g"), ("unrelated", "")):
        fresh = LLMEngine(engine.runner, engine.config, engine.eos_token_ids, engine.vocab_size, engine.model_max_len)
        print(
            label,
            {"n": a.n, "prompt": a.prompt, "max_tokens": a.max_tokens, **run(fresh, prompt, a.n, a.max_tokens, group)},
            flush=True,
        )


if __name__ == "__main__":
    main()
