"""What log probabilities cost at batch 32: the sampler alone, and whole engine decode steps.

  (a) sampler.sample on 32 rows of the model's vocabulary (random logits), per mode: greedy, drawn through
      the C++ kernel (when it builds) and drawn in torch; without logprobs, and with logprobs 0 / 5 / 20 on
      every row. Median of --reps calls.
  (b) the engine in process with the real model: 32 chat prompts decoding together (greedy, ignore_eos), the
      median wall time of a decode step without logprobs and with logprobs 5 / 20 on every request,
      interleaved runs (--rounds) so drift hits each alike.

Each figure is given as wall time and as this process's CPU time (all its threads): on a machine shared with
other work the wall time measures the neighbours too, the CPU time much less so.

Run: .venv/bin/python -m benchmarks.engine.logprobs_cost  [--reps 50] [--rounds 2] [--tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.engine_throughput import chat_prompts, load
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.sampling.sampler import sample
from shared.text.model_files import resolve_model_dir

BATCH = 32
LOGPROBS = (None, 0, 5, 20)


class Row:
    """What the sampler reads of a sequence."""

    def __init__(self, opts: SamplingOptions, seed: int):
        self.sampling, self.token_ids, self.num_prompt_tokens, self.stop_ids = opts, [1, 2, 3], 3, frozenset()
        self.generator = torch.Generator().manual_seed(seed)

    num_outputs = 0


def sampler_costs(vocab: int, reps: int, native_ok: bool) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(BATCH, vocab) * 3
    out = {}
    modes = [("greedy", 0.0, False), ("drawn, torch", 0.8, False)] + ([("drawn, C++", 0.8, True)] if native_ok else [])
    for name, temperature, native in modes:
        for k in LOGPROBS:
            rows = [Row(SamplingOptions(temperature=temperature, logprobs=k), i) for i in range(BATCH)]
            for _ in range(3):
                sample(logits, rows, native)
            wall, cpu = [], []
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                sample(logits, rows, native)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            fig = out[f"{name}, logprobs={k}"] = {
                "wall_ms": statistics.median(wall) * 1e3,
                "cpu_ms": statistics.median(cpu) * 1e3,
            }
            print(
                f"  sampler {name:13s} logprobs={str(k):4s} wall {fig['wall_ms']:7.2f} ms  cpu {fig['cpu_ms']:7.2f} ms",
                flush=True,
            )
    return out


def decode_steps(
    engine: LLMEngine, prompts: list[list[int]], tokens: int, k: int | None, tag: str
) -> list[tuple[float, float]]:
    """(wall s, CPU s) of each step where all of prompts decode."""
    for i, p in enumerate(prompts):
        engine.add_request(
            EngineRequest(
                f"{tag}-{i}", p, SamplingOptions(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=k)
            )
        )
    times = []
    while engine.has_unfinished():
        c0 = time.process_time()
        r = engine.step()
        if r.num_prefill_tokens == 0 and r.num_decode_tokens == len(prompts):
            times.append((r.step_time_s, time.process_time() - c0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    a = ap.parse_args()
    model_dir = resolve_model_dir("", Path.home() / ".cache" / "conveyor")
    model = load(model_dir)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        native_ok = cpu_ops.load(tmp)
        print(f"(a) sampler, {BATCH} rows x {vocab}, {torch.get_num_threads()} threads", flush=True)
        result = {"sampler_ms": sampler_costs(vocab, a.reps, native_ok)}
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(str(model_dir)), BATCH)
    engine = LLMEngine.from_model(
        model,
        EngineConfig(num_kv_blocks=1024, max_num_seqs=BATCH, max_num_batched_tokens=2048, enable_prefix_caching=False),
    )
    decode_steps(engine, prompts, 4, None, "warm")
    steps: dict[str, list[tuple[float, float]]] = {str(k): [] for k in (None, 5, 20)}
    for rnd in range(a.rounds):
        for k in (None, 5, 20):
            steps[str(k)] += decode_steps(engine, prompts, a.tokens, k, f"r{rnd}-{k}")
    result["decode_step_ms"] = {
        k: {"wall_ms": statistics.median(w for w, _ in v) * 1e3, "cpu_ms": statistics.median(c for _, c in v) * 1e3}
        for k, v in steps.items()
    }
    print(f"(b) engine decode step at batch {BATCH} (median of {len(steps['None'])} steps each):", flush=True)
    for k, fig in result["decode_step_ms"].items():
        print(f"  logprobs={k:4s} wall {fig['wall_ms']:7.2f} ms  cpu {fig['cpu_ms']:7.2f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
