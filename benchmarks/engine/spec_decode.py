"""Prompt-lookup speculative decoding (engine/spec.py): what it buys a single greedy stream, where it applies and
where it does not, measured side by side in one process.

Two engines of the worker's default configuration, one with drafts (--tokens per step) and one without, each on
its own copy of the model, run the same requests one at a time (a single stream, c=1: where a CPU decode step is
memory-bound and checking drafts is nearly free), in interleaved rounds so drift hits both alike. Workloads:

  rewrite  the answer repeats much of the prompt: fix the spelling of a paragraph, add type hints to a function,
           reformat a list as JSON (editing, refactoring, extraction: where prompt lookup is meant to help)
  chat     short open questions (tests/support's kind): the answer repeats little
  random   random token ids, --ignore-eos, as `vllm bench serve --dataset-name random` sends: nothing repeats

Per workload and engine: output tokens, engine steps, ms per output token (the wall time of the steps / tokens),
drafts checked and accepted; the ratio without / with. Both engines' outputs are compared token for token
(greedy: they must be equal).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.engine.spec_decode [--rounds 3] [--tokens 4]
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

from benchmarks.common import DEFAULT_OUT, print_table, stamp, write_json
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.cpu.cpu_info import this_cpu
from shared.text.model_files import resolve_model_dir
from shared.settings import CommonSettings

PASSAGE = (
    "Teh printing press was invented by Johannes Gutenberg arround 1440 in the city of Mainz. It used movable "
    "metal type, oil based ink and a wooden press adapted from the ones used for making wine. Within fifty years "
    "presses were working in more then two hundred cities, and milions of books had been printed."
)
FUNCTION = (
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)
ITEMS = "name: Ada Lovelace, born: 1815, field: mathematics; name: Alan Turing, born: 1912, field: computing"
REWRITE = [
    f"Correct the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\n{PASSAGE}",
    f"Add Python type hints to this function and return the whole function:\n\n{FUNCTION}",
    f"Rewrite these records as a JSON list of objects with the keys name, born and field:\n\n{ITEMS}",
    f"Repeat this text exactly:\n\n{PASSAGE}",
]
CHAT = [
    "Why is the sky blue? Answer for a ten year old child.",
    "Give me a short tip for writing clean Python code.",
    "Describe a cat to someone who has never seen one.",
    "Recommend a book about the history of mathematics.",
]


def workloads(model_dir: Path, max_tokens: int, seed: int) -> dict[str, list[EngineRequest]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def chat(q: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    greedy = SamplingOptions(temperature=0.0, max_tokens=max_tokens)
    rng = random.Random(seed)
    rand = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {
        "rewrite": [EngineRequest(f"w{i}", chat(q), greedy) for i, q in enumerate(REWRITE)],
        "chat": [EngineRequest(f"c{i}", chat(q), greedy) for i, q in enumerate(CHAT)],
        "random": [
            EngineRequest(f"r{i}", [rng.randrange(100, 40000) for _ in range(128)], rand) for i in range(len(CHAT))
        ],
    }


def run_one(engine: LLMEngine, req: EngineRequest, tag: str) -> tuple[list[int], int, float]:
    """-> (output tokens, steps, seconds) of one request alone on the engine."""
    r = EngineRequest(f"{req.request_id}-{tag}", req.prompt_token_ids, req.sampling)
    engine.add_request(r)
    tokens, steps = [], 0
    t = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step().outputs:
            tokens += o.new_token_ids
        steps += 1
    return tokens, steps, time.perf_counter() - t


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4, help="drafts per step (spec_ngram_tokens)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args()


def run_rounds(engines: dict[int, LLMEngine], loads: dict, rounds: int, drafts: int) -> tuple[dict, list[str]]:
    """-> (tokens, steps and seconds per workload and engine, the requests whose outputs differed between the
    engines without drafts and with `drafts`): every request on each engine in turn, each round."""
    tally = {(w, k): {"tokens": 0, "steps": 0, "seconds": 0.0} for w in loads for k in engines}
    mismatches = []
    for r in range(rounds):
        for w, reqs in loads.items():
            for req in reqs:
                outs = {}
                for k, e in engines.items():
                    tokens, steps, sec = run_one(e, req, f"{r}-{k}")
                    outs[k] = tokens
                    t = tally[(w, k)]
                    t["tokens"] += len(tokens)
                    t["steps"] += steps
                    t["seconds"] += sec
                if outs[0] != outs[drafts]:
                    mismatches.append(req.request_id)
    return tally, mismatches


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    s = CommonSettings()
    model_dir = resolve_model_dir(s.model, s.cache_dir)
    engines = {
        k: LLMEngine.from_model_dir(
            model_dir, EngineConfig(tuning_cache_dir=str(s.cache_dir), enable_prefix_caching=False, spec_ngram_tokens=k)
        )
        for k in (0, args.tokens)
    }
    loads = workloads(model_dir, args.max_tokens, seed=0)
    for e in engines.values():  # warm: one request of each workload, not measured
        for reqs in loads.values():
            run_one(e, reqs[0], "warm")
    tally, mismatches = run_rounds(engines, loads, args.rounds, args.tokens)
    rows, result = [], {"cpu": this_cpu(), "tokens": args.tokens, "rounds": args.rounds, "workloads": {}}
    for w in loads:
        off, on = tally[(w, 0)], tally[(w, args.tokens)]
        ms_off = off["seconds"] / off["tokens"] * 1e3
        ms_on = on["seconds"] / on["tokens"] * 1e3
        result["workloads"][w] = {"off": off, "on": on, "ms_per_token_off": ms_off, "ms_per_token_on": ms_on}
        rows.append(
            [w, off["tokens"], off["steps"], on["steps"], f"{ms_off:.1f}", f"{ms_on:.1f}", f"{ms_off / ms_on:.2f}"]
        )
    st = engines[args.tokens].stats()
    result |= {"drafted": st.num_drafted, "accepted": st.num_draft_accepted, "mismatches": mismatches}
    print_table(
        ["workload", "tokens", "steps off", f"steps on ({args.tokens})", "ms/tok off", "ms/tok on", "speedup"], rows
    )
    print(
        f"drafts checked {st.num_drafted}, accepted {st.num_draft_accepted}; outputs differing: {mismatches or 'none'}"
    )
    print(f"written: {write_json(Path(args.out), 'spec_decode', result, stamp())}")


if __name__ == "__main__":
    main()
