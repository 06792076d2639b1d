"""What bfloat16 costs in accuracy: greedy outputs of the engine in bfloat16 against float32, same prompts.

The 32 chat prompts of engine_throughput, N greedy tokens each (ignore_eos), through the engine in process
in both dtypes. Prints how many outputs are identical, and where the others first differ (the tokens before
the first difference are the same; after it a greedy continuation follows its own path).

Run: .venv/bin/python -m benchmarks.engine.dtype_agreement [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from transformers import AutoTokenizer

from benchmarks.engine.engine_throughput import QUESTIONS, chat_prompts
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings


def generate(model_dir, dtype: str, prompts: list[list[int]], tokens: int, cache_dir: str) -> list[list[int]]:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(dtype=dtype, tuning_cache_dir=cache_dir))
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingOptions(temperature=0, max_tokens=tokens, ignore_eos=True)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    s = CommonSettings()
    model_dir = resolve_model_dir(s.model, s.cache_dir)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(str(model_dir)), len(QUESTIONS))
    ref = generate(model_dir, "float32", prompts, args.tokens, str(s.cache_dir))
    low = generate(model_dir, "bfloat16", prompts, args.tokens, str(s.cache_dir))
    diffs = [first_difference(a, b) for a, b in zip(ref, low)]
    same = sum(d is None for d in diffs)
    agree = [args.tokens if d is None else d for d in diffs]
    print(
        f"bfloat16 vs float32, {len(prompts)} prompts x {args.tokens} greedy tokens: {same} identical; "
        f"tokens before the first difference: mean {statistics.fmean(agree):.1f}, "
        f"min {min(agree)}; first differences at {sorted(d for d in diffs if d is not None)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "identical": same, "first_difference": diffs}, f)


if __name__ == "__main__":
    main()
