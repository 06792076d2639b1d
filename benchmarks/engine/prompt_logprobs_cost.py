"""What `prompt_logprobs` costs: a request's prefill wall time (its first token) with the real model in process.

A request that still owes prompt log probabilities is not served from the prefix cache (prompt_logprobs.py): every
prompt position's hidden state is computed, and the LM head runs over them 128 rows at a time. Measured, one
request at a time, on one --tokens-long prompt (max_tokens 1), medians of --reps interleaved runs:

  cold            no prompt_logprobs, a prompt never seen (its first token varies: nothing cached)
  cached          no prompt_logprobs, the same prompt again (all its full blocks from the prefix cache)
  prompt_lp=K     prompt_logprobs K, the same (cached) prompt: the cache bypassed, K = 0, 5, 20

Run: .venv/bin/python -m benchmarks.engine.prompt_logprobs_cost [--tokens 512] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.engine.engine_throughput import load
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from shared.text.model_files import resolve_model_dir
from tests.support.engine import PASSAGE

MODES = ("cold", "cached", "prompt_lp=0", "prompt_lp=5", "prompt_lp=20")


def first_token_s(engine: LLMEngine, rid: str, prompt: list[int], k: int | None) -> tuple[float, float]:
    """(wall s, CPU s) from adding the request to its first token."""
    t0, c0 = time.perf_counter(), time.process_time()
    engine.add_request(EngineRequest(rid, prompt, SamplingOptions(temperature=0, max_tokens=1, prompt_logprobs=k)))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    model_dir = resolve_model_dir("", Path.home() / ".cache" / "conveyor")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(PASSAGE * 8)[: a.tokens]
    engine = LLMEngine.from_model(
        load(model_dir), EngineConfig(num_kv_blocks=1024, max_num_seqs=8, max_num_batched_tokens=2048)
    )
    first_token_s(engine, "warm", ids, None)  # the prompt's blocks now cached
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rep in range(a.reps):
        for mode in MODES:
            prompt = [100 + rep, *ids[1:]] if mode == "cold" else ids
            k = int(mode.split("=")[1]) if "=" in mode else None
            times[mode].append(first_token_s(engine, f"{mode}-{rep}", prompt, k))
    result = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "tokens": len(ids),
        "reps": a.reps,
        "ms": {
            m: {"wall": statistics.median(w for w, _ in v) * 1e3, "cpu": statistics.median(c for _, c in v) * 1e3}
            for m, v in times.items()
        },
    }
    for m, fig in result["ms"].items():
        print(f"  {m:13s} wall {fig['wall']:8.1f} ms  cpu {fig['cpu']:8.1f} ms", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
