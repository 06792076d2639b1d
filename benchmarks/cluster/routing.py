"""KV-cache-aware routing: kv vs load vs round_robin placement, side by side in one run.

For each worker count and routing mode a fresh `conveyor up` (CONVEYOR_ROUTING=mode) serves two workloads, one
after the other (disjoint prompts, so one cannot warm the cache for the other):
- shared_prefix: --groups groups, each a --context-token shared context, every request it plus --unique unique
  tokens, arriving interleaved (group 0, 1, ..., G-1, 0, 1, ...) at --rate requests/s, --per-group each.
- chat: --conversations multi-turn chats of --turns turns, each turn the whole conversation so far (a
  --system-token system context, the earlier turns with the model's answers) plus a new --unique-word user
  message; a conversation sends its next turn when the previous answer has arrived; conversations start at
  --rate per second.
Streams are greedy /v1 requests with usage; per workload and mode: prefix-cache hit rate (usage cached_tokens /
prompt_tokens, and as a share of the ideal: every full block some earlier request computed, anywhere, is
reused), TTFT p50/p99 seen by the client, output tokens/s and requests/s over the workload's span.
Writes JSON into --out and, with --plot, a PNG.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.cluster.routing --engine sim --workers 4 8 --plot docs/routing-sim.png
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

from benchmarks.common import MODEL_NAME, ConveyorUp, model_dir, percentile, print_table, stamp, write_json
from benchmarks.scale.sse_client import Connection, StreamRecord
from shared.wire.block_hash import block_hashes

MODES = ("kv", "load", "round_robin")
BLOCK = 16
SIM_ENV = {
    "CONVEYOR_SIM_SPEEDUP": "10",  # a device 10x this CPU: a 1,024-token prefill models ~0.15 s
    # 409 blocks a worker: room for about 6 of the 16 contexts of 65 blocks, so a worker that sees every group
    # evicts (the regime routing is for: all the prompts' working set is larger than one worker's cache), while
    # the 4 contexts a worker gets under kv routing with 4 workers fit with their requests' own blocks.
    "CONVEYOR_KV_CACHE_BYTES": str(288 << 20),
}


def word_texts(tok, words: list[int], rng: random.Random, n: int) -> str:
    """About n tokens of plain words (each word one token of the served tokenizer)."""
    return tok.decode(rng.choices(words, k=n))


class Workloads:
    def __init__(self, args):
        from services.worker.engine.sim.sim_model import load_vocab
        from shared.text.tokenization import load_tokenizer

        mdir = model_dir()
        self.tok, self.words = load_tokenizer(mdir), list(load_vocab(mdir).words[:5000])
        self.args = args

    def shared_prefix(self, seed: int) -> list[str]:
        a, rng = self.args, random.Random(seed)
        contexts = [word_texts(self.tok, self.words, rng, a.context) for _ in range(a.groups)]
        # Interleaved: every round sends one request of each group, the groups in a new random order each round
        # (a fixed order would line the groups up with round_robin's turns).
        order = [g for _ in range(a.per_group) for g in rng.sample(range(a.groups), a.groups)]
        return [contexts[g] + word_texts(self.tok, self.words, rng, a.unique) for g in order]

    def chat_turns(self, seed: int) -> list[tuple[str, list[str]]]:
        """Per conversation: (system context, user messages of its turns)."""
        a, rng = self.args, random.Random(seed)
        return [
            (
                word_texts(self.tok, self.words, rng, a.system),
                [word_texts(self.tok, self.words, rng, a.unique) for _ in range(a.turns)],
            )
            for _ in range(a.conversations)
        ]

    def prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            text = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            return self.tok.encode(text, add_special_tokens=False)
        return self.tok.encode(body["prompt"])


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """Hit rate of one infinite cache seeing the prompts in order: each reuses every leading full block an
    earlier one computed (never the block of its last token, which the engine always computes)."""
    seen: set[bytes] = set()
    hits = total = 0
    for ids in prompts:
        hashes = block_hashes(ids, BLOCK)
        n = 0
        for h in hashes[: (len(ids) - 1) // BLOCK]:
            if h not in seen:
                break
            n += 1
        hits, total = hits + n * BLOCK, total + len(ids)
        seen.update(hashes)
    return hits / total


async def stream(port: int, body: dict, sent: list) -> StreamRecord:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    conn, rec = Connection("127.0.0.1", port), StreamRecord(0, time.perf_counter())
    sent.append((rec.t_start, body))
    await conn.stream(path, body, "chat" if "messages" in body else "completions", rec)
    conn.close()
    return rec


def body(args, prompt: str | None = None, messages: list | None = None) -> dict:
    b = {
        "model": MODEL_NAME,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return {**b, "messages": messages} if messages is not None else {**b, "prompt": prompt}


async def run_shared_prefix(port: int, args, prompts: list[str], sent: list) -> list[StreamRecord]:
    tasks = []
    for i, p in enumerate(prompts):
        tasks.append(asyncio.create_task(stream(port, body(args, prompt=p), sent)))
        await asyncio.sleep(1 / args.rate)
    return list(await asyncio.gather(*tasks))


async def run_chat(port: int, args, convs: list[tuple[str, list[str]]], sent: list) -> list[StreamRecord]:
    async def conversation(i: int, system: str, users: list[str]) -> list[StreamRecord]:
        await asyncio.sleep(i / args.rate)
        messages, recs = [{"role": "system", "content": system}], []
        for user in users:
            messages.append({"role": "user", "content": user})
            rec = await stream(port, body(args, messages=list(messages)), sent)
            recs.append(rec)
            messages.append({"role": "assistant", "content": "".join(rec.text)})
        return recs

    per_conv = await asyncio.gather(*(conversation(i, s, u) for i, (s, u) in enumerate(convs)))
    return [r for recs in per_conv for r in recs]


def summarize(recs: list[StreamRecord], ideal: float) -> dict:
    ok = [r for r in recs if not r.error and r.ttft is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    span = max(r.t_end for r in ok) - min(r.t_start for r in ok) if ok else None
    hit = cached / prompt if prompt else None
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "hit_rate": hit,
        "ideal_hit_rate": ideal,
        "of_ideal": hit / ideal if hit is not None and ideal else None,
        "ttft_p50": percentile([r.ttft for r in ok], 50),
        "ttft_p99": percentile([r.ttft for r in ok], 99),
        "tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / span if span else None,
        "requests_per_s": len(ok) / span if span else None,
    }


async def measure(port: int, args, work: Workloads) -> dict:
    out = {}
    for name, run, data in (
        ("shared_prefix", run_shared_prefix, work.shared_prefix(1)),
        ("chat", run_chat, work.chat_turns(2)),
    ):
        sent: list = []
        recs = await run(port, args, data, sent)
        ideal = ideal_hit_rate([work.prompt_ids(b) for _, b in sorted(sent, key=lambda s: s[0])])
        out[name] = summarize(recs, ideal)
        print(f"  {name}: {out[name]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("sim", "torch"), default="sim")
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="tokens of a group's shared context")
    ap.add_argument("--unique", type=int, default=32, help="unique tokens of a request / user message")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512, help="tokens of a conversation's system context")
    ap.add_argument("--rate", type=float, default=16.0, help="arrivals per second (requests; conversations)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV pool of each worker (sim default: 288 MiB, 409 blocks; torch: the setting's default)",
    )
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of hit rate and TTFT here")
    args = ap.parse_args(argv)
    work, run_id = Workloads(args), stamp()
    env = {
        **(SIM_ENV if args.engine == "sim" else {}),
        "CONVEYOR_TIMEOUT_MIN_S": "600",
        **({"CONVEYOR_KV_CACHE_BYTES": str(args.kv_cache_bytes)} if args.kv_cache_bytes else {}),
    }
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "env": env, "runs": {}}
    for n in args.workers:
        for mode in args.modes:
            print(f"{n} {args.engine} workers, routing={mode}", flush=True)
            log = args.out / f"routing-{run_id}-{n}-{mode}.log"
            with ConveyorUp(
                log, workers=n, env={**env, "CONVEYOR_ROUTING": mode}, args=["--engine", args.engine]
            ) as up:
                results["runs"][f"{n}/{mode}"] = asyncio.run(measure(up.port, args, work))
            log.unlink(missing_ok=True)  # kept only while it runs: the JSON holds the results
    report(results)
    path = write_json(args.out, "routing", results, run_id)
    print(f"wrote {path}")
    if args.plot:
        plot(results, args.plot, args.engine)
        print(f"wrote {args.plot}")
    return 0


def report(results: dict) -> None:
    rows = []
    for key, per in results["runs"].items():
        for wl, m in per.items():
            rows.append(
                [
                    key,
                    wl,
                    m["hit_rate"],
                    m["of_ideal"],
                    m["ttft_p50"],
                    m["ttft_p99"],
                    m["tokens_per_s"],
                    m["requests_per_s"],
                    m["errors"],
                ]
            )
    print_table(
        ["workers/mode", "workload", "hit rate", "of ideal", "TTFT p50 s", "TTFT p99 s", "tok/s", "req/s", "errors"],
        rows,
    )
    for key in {k.split("/")[0] for k in results["runs"]}:
        kv, load = results["runs"].get(f"{key}/kv"), results["runs"].get(f"{key}/load")
        if kv and load:
            for wl in kv:
                a, b = kv[wl]["ttft_p50"], load[wl]["ttft_p50"]
                if a and b:
                    print(f"{key} workers, {wl}: TTFT p50 load / kv = {b / a:.1f}x")


def plot(results: dict, path: Path, engine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k.split("/")[0] for k in results["runs"]}, key=int)
    workloads = list(next(iter(results["runs"].values())))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for row, wl in enumerate(workloads):
        for col, (metric, label) in enumerate((("hit_rate", "prefix-cache hit rate"), ("ttft_p50", "TTFT p50 (s)"))):
            ax = axes[row][col]
            for i, mode in enumerate(MODES):
                vals = [(results["runs"].get(f"{k}/{mode}") or {}).get(wl, {}).get(metric) or 0 for k in keys]
                ax.bar([j + (i - 1) * 0.27 for j in range(len(keys))], vals, 0.27, label=mode)
            if metric == "hit_rate":
                ideal = [results["runs"][f"{k}/kv"][wl]["ideal_hit_rate"] for k in keys if f"{k}/kv" in results["runs"]]
                ax.scatter(range(len(ideal)), ideal, marker="_", s=900, color="black", label="ideal")
            ax.set_xticks(range(len(keys)), [f"{k} {engine} workers" for k in keys])
            ax.set_title(f"{wl}: {label}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
