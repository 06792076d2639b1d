"""Engine throughput: 32 chat prompts x 64 greedy tokens (ignore_eos), three ways, same run.

  (a) transformers `generate`, one prompt at a time
  (b) transformers' own continuous batching, `model.generate_batch`
  (c) this engine, in process (`LLMEngine.step()` until done)

Prints output tokens/s of each, the ratios c/a and c/b, time per engine step and the share
of each batch-32 step spent outside the model's forward pass.
Run: .venv/bin/python -m benchmarks.engine.engine_throughput  [--sequential-prompts 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from shared.text.model_files import resolve_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "Hi!",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your steps.",
    "Give me a short tip for writing clean Python code.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue? Answer for a ten year old child who is curious about science and nature.",
    "Name a famous painter.",
    "Describe a cat to someone who has never seen one, using three senses.",
    "What does HTTP stand for?",
    "Tell me a fun fact about octopuses.",
    "How do I boil an egg? I want the yolk soft but the white fully set.",
    "Recommend a book for learning about the history of mathematics.",
    "What is photosynthesis?",
    "Write a limerick about a programmer who loves coffee.",
    "How many legs does a spider have?",
    "Explain what a linked list is and when to use one.",
    "Suggest a name for a friendly robot.",
    "What are the primary colors?",
    "Give three tips for a job interview.",
    "What is the difference between weather and climate?",
    "Write a two-line poem about autumn leaves.",
    "How does a rainbow form?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Describe the taste of a lemon.",
    "Why do we have leap years?",
    "Plan a one-day trip to a big city museum.",
    "What is machine learning, in simple words?",
    "Tell me a short story about a brave mouse.",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"])
        for q in QUESTIONS[:n]
    ]


def load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def run_sequential(model, prompts: list[list[int]], n: int) -> dict:
    """(a) one `generate` per prompt; min_new_tokens keeps EOS from ending it early (same work)."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=2)
    warm = GenerationConfig(do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=2)
    model.generate(torch.tensor([prompts[0]]), generation_config=warm)
    t0 = time.perf_counter()
    tokens = 0
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        tokens += out.shape[1] - len(p)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def run_hf_batch(model, prompts: list[list[int]], n: int) -> dict:
    """(b) transformers continuous batching; eos_token_id=None disables EOS (like ignore_eos)."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=2)
    model.generate_batch(inputs=prompts[:2], generation_config=cfg, progress_bar=False)  # warm
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    wall = time.perf_counter() - t0
    outs = [list(r.generated_tokens) for r in res.values()]
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "outputs": outs}


def run_engine(model, prompts: list[list[int]], n: int, cfg: EngineConfig) -> dict:
    """(c) this engine; a throwaway engine warms the model first, the timed one starts cold."""
    opts = SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True)
    warm = LLMEngine.from_model(model, cfg)
    warm.add_request(EngineRequest("warm", [1, 2, 3, 4, 5, 6, 7, 8], opts))
    while warm.has_unfinished():
        warm.step()
    del warm
    engine = LLMEngine.from_model(model, cfg)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, opts))
    while engine.has_unfinished():
        r = engine.step()
        steps.append((r.num_seqs, r.num_prefill_tokens, r.step_time_s, r.forward_time_s))
        for o in r.outputs:
            outs[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    engine.check_no_leak()
    tokens = sum(len(o) for o in outs.values())
    full = [s for s in steps if s[0] == len(prompts) and s[1] == 0]  # pure decode steps at full batch
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "steps": len(steps),
        "step_s": statistics.mean(s[2] for s in steps),
        "decode_step_s": statistics.mean(s[2] for s in full) if full else None,
        "overhead_share": statistics.mean((s[2] - s[3]) / s[2] for s in full) if full else None,
        "prefill_steps": sum(1 for s in steps if s[1] > 0),
        "stats": engine.stats().__dict__,
        "outputs": [outs[str(i)] for i in range(len(prompts))],
    }


def one_round(models: dict, prompts: list[list[int]], n: int, sequential: int) -> dict[str, dict]:
    res: dict[str, dict] = {}
    if "a" in models:
        res["a"] = run_sequential(models["a"], prompts[: sequential or None], n)
        print(f"(a) HF generate one by one:   {res['a']['tok_s']:7.1f} tok/s  ({res['a']['wall_s']:.1f} s)")
    if "b" in models:
        res["b"] = run_hf_batch(models["b"], prompts, n)
        print(f"(b) HF generate_batch (CB):   {res['b']['tok_s']:7.1f} tok/s  ({res['b']['wall_s']:.1f} s)")
    c = res["c"] = run_engine(models["c"], prompts, n, EngineConfig())
    print(
        f"(c) Conveyor engine:          {c['tok_s']:7.1f} tok/s  ({c['wall_s']:.1f} s, {c['steps']} steps, "
        f"{c['prefill_steps']} with prefill)"
    )
    for k in ("a", "b"):
        if k in res:
            print(f"c/{k} = {c['tok_s'] / res[k]['tok_s']:.2f}")
    if c["decode_step_s"] is not None:
        print(
            f"engine step: mean {c['step_s'] * 1e3:.1f} ms; decode step at batch {len(prompts)}: "
            f"{c['decode_step_s'] * 1e3:.1f} ms, {c['overhead_share'] * 100:.1f}% outside the forward pass"
        )
    if "b" in res:
        same = sum(x == y for x, y in zip(res["b"]["outputs"], c["outputs"]))
        print(f"outputs identical to (b): {same}/{len(prompts)}")
    print(f"load average now: {os.getloadavg()[0]:.2f} (other work on the machine skews every number)")
    return res


def summarise(rounds: list[dict[str, dict]]) -> dict:
    """Best round of each (noise only ever slows a run down) and the per-round ratios."""
    best = {k: max(r[k]["tok_s"] for r in rounds) for k in rounds[0]}
    out = {"best_tok_s": best, "rounds": len(rounds)}
    for k in ("a", "b"):
        if k in best:
            out[f"best_c_over_{k}"] = best["c"] / best[k]
            out[f"round_c_over_{k}"] = [r["c"]["tok_s"] / r[k]["tok_s"] for r in rounds]
    print(
        "best of %d round(s): " % len(rounds)
        + ", ".join(f"({k}) {v:.1f} tok/s" for k, v in best.items())
        + "".join(f"; c/{k} = {out[f'best_c_over_{k}']:.2f}" for k in ("a", "b") if k in best)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model folder or .gguf (default: bundled SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--sequential-prompts",
        type=int,
        default=0,
        help="time (a) on only the first K prompts (tok/s is per token either way); 0 = all",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat a, b, c interleaved; report the best of each")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: a,b")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = resolve_model_dir(args.model, Path.home() / ".cache" / "conveyor")
    prompts = chat_prompts(AutoTokenizer.from_pretrained(str(model_dir)), args.num_prompts)
    n, skip = args.max_tokens, set(filter(None, args.skip.split(",")))
    print(
        f"{len(prompts)} prompts ({sum(map(len, prompts))} prompt tokens), {n} tokens each, "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )
    models = {k: load(model_dir) for k in ("a", "b", "c") if k not in skip}  # one instance each, reused
    rounds = []
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"-- round {i + 1}/{args.rounds}")
        rounds.append(one_round(models, prompts, n, args.sequential_prompts))
    summary = summarise(rounds) if args.rounds > 1 else {}
    if args.json:
        clean = [{k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in r.items()} for r in rounds]
        args.json.write_text(json.dumps({"rounds": clean, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
