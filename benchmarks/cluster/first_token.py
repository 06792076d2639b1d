"""Where a single stream's first token goes: the hops before and after its prefill, per variant, side by side.

Each variant is a Conveyor cluster (`conveyor up`, one worker) started with environment variables of its own. It
serves --requests streamed prompts of --prompt-tokens random tokens (their text, as `vllm bench serve`'s random
dataset makes it) one at a time, each sent when the one before ended, as the benchmark client does at c=1 (--gap S:
S seconds of idling in between, a user's think time). Each request's state history (GET /v1/requests/{id}: every
transition stamped by the service that made it, on this host's clock) splits its time to first token into:

  gateway     the client's send to RECEIVED: HTTP, validation, the context created
  tokenizer   RECEIVED to PREPROCESSED: the tokenizer's read, the prompt tokenized, its transition
  scheduler   PREPROCESSED to SCHEDULED (QUEUED between): queued, placed
  worker      SCHEDULED to PREFILLING: the worker's read and its stamp
  prefill     PREFILLING to DECODING: the prefill step
  to client   DECODING to the first token at the client: the publish, the gateway's read, SSE

Variants take turns (each start its own, --starts rounds of all), so the machine's drift hits them alike; the first
--skip requests of each start are left out (the first after /ready).

Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.cluster.first_token \\
       --variant default: --variant no-thp:CONVEYOR_MALLOC_HUGE_PAGES=false [--starts 2] [--gap 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmarks.common import DEFAULT_OUT, ConveyorUp, model_dir, print_table, stamp, write_json

SEGMENTS = ("gateway", "tokenizer", "scheduler", "worker", "prefill", "to client")
# The state each segment ends at (the history's stamp); "to client" ends at the client's first token.
ENDS = {"gateway": "RECEIVED", "tokenizer": "PREPROCESSED", "scheduler": "SCHEDULED", "worker": "PREFILLING"}


def variant(text: str) -> tuple[str, dict]:
    """NAME:K=V,K=V (NAME: alone for the defaults)."""
    name, _, pairs = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in pairs.split(",") if kv)


def one_request(client: httpx.Client, url: str, model: str, prompt: str, tokens: int) -> dict:
    """A streamed completion: its segments (ms) from its history and the client's clock."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    sent, first = time.time(), None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.time()
    at = {e["state"]: e["t"] for e in client.get(f"{url}/v1/requests/{rid}").json()["history"]}
    marks = [sent, *(at[ENDS[s]] for s in SEGMENTS[:4]), at["DECODING"], first]
    out = {s: 1000 * (b - a) for s, a, b in zip(SEGMENTS, marks, marks[1:])}
    out["ttft"] = 1000 * (first - sent)
    return out


def run_start(name: str, env: dict, args, prompts: list[str], out: Path) -> list[dict]:
    with ConveyorUp(out / f"conveyor-{name}.log", env=env) as up:
        with httpx.Client(timeout=300) as client:
            model = client.get(f"{up.url}/v1/models").json()["data"][0]["id"]
            rows = []
            for prompt in prompts:
                rows.append(one_request(client, up.url, model, prompt, args.tokens))
                if args.gap:
                    time.sleep(args.gap)
    return rows[args.skip :]


def summary(rows: list[dict]) -> dict:
    return {k: statistics.mean(r[k] for r in rows) for k in (*SEGMENTS, "ttft")} | {
        "ttft_median": statistics.median(r["ttft"] for r in rows)
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", type=variant, required=True, help="NAME:K=V,K=V (repeat)")
    ap.add_argument("--starts", type=int, default=2, help="starts of each variant, taking turns")
    ap.add_argument("--requests", type=int, default=12, help="requests a start serves (the first --skip left out)")
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds idled between requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    run_id = stamp()
    out = args.out / f"first_token-{run_id}"
    tok = AutoTokenizer.from_pretrained(model_dir())
    rng = random.Random(args.seed)
    starts: dict[str, list[dict]] = {name: [] for name, _ in args.variant}
    for k in range(args.starts):
        for name, env in args.variant:
            # Fresh prompts each start: none is in a prefix cache.
            prompts = [
                tok.decode([rng.randrange(1000, tok.vocab_size) for _ in range(args.prompt_tokens)])
                for _ in range(args.requests)
            ]
            rows = run_start(name, env, args, prompts, out)
            starts[name].append(summary(rows))
            print(f"{name} start {k + 1}: " + ", ".join(f"{s} {v:.1f}" for s, v in starts[name][-1].items()))
    headers = ["variant", "start", *SEGMENTS, "TTFT mean", "median"]
    print(f"\nmean ms per segment, {args.requests - args.skip} requests a start (c=1, gap {args.gap} s)")
    print_table(
        headers,
        [
            [name, k + 1, *(f"{s[x]:.1f}" for x in SEGMENTS), f"{s['ttft']:.1f}", f"{s['ttft_median']:.1f}"]
            for name, runs in starts.items()
            for k, s in enumerate(runs)
        ],
    )
    path = write_json(
        args.out,
        "first_token",
        {"variants": dict(args.variant), "args": {k: v for k, v in vars(args).items() if k != "variant"}}
        | {"starts": starts},
        run_id,
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
