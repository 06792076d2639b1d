"""CPU contention: the greedy suite on a `conveyor up` cluster, first on a quiet machine, then beside CPU hogs.

`conveyor up --workers 1` with every setting at its default (no timeout changed; CONVEYOR_* variables of the
calling shell are dropped). The suite: 8 fixed chat prompts, 64 greedy tokens each (ignore_eos), with no
`timeout` in the request and no client timeout, so the adaptive deadlines decide; sent one at a time, then
--concurrency at once. The baseline runs first; then --hogs CPU-bound processes (Python busy loops, nice 0 by
default) start beside the cluster and the same suite runs again, in the same run.
Prints, per phase and mode, how many requests got 200, 504 and other errors (the goal is no 504 and no error)
and their latencies; writes JSON (every request, and the cluster's log) into --out.
Run: .venv/bin/python -m benchmarks.cluster.cpu_contention [--hogs 3] [--concurrency 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.common import (
    PROMPTS,
    DEFAULT_OUT,
    ConveyorUp,
    log_summary,
    percentile,
    print_table,
    stamp,
    start_hogs,
    stop_hogs,
    write_json,
)


async def one(client: httpx.AsyncClient, url: str, prompt: str, args) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": not args.allow_eos,
    }
    t0 = time.perf_counter()
    rec: dict = {"prompt": prompt}
    try:
        r = await client.post(f"{url}/generate", json=body)
        data = r.json()
        rec.update(status=r.status_code, request_id=r.headers.get("x-request-id"))
        if r.status_code == 200:
            rec.update(
                finish_reason=data["finish_reason"],
                tokens=data["usage"]["completion_tokens"],
                metrics=data.get("metrics"),
            )
        else:
            err = data.get("error") or {}
            rec.update(
                error=f"{err.get('code')}: {err.get('message')}",
                partial_tokens=len((err.get("partial") or {}).get("token_ids") or []),
            )
    except (httpx.HTTPError, ValueError) as e:
        rec.update(status=None, error=f"{type(e).__name__}: {e}")
    rec["latency_s"] = time.perf_counter() - t0
    return rec


async def run_suite(url: str, concurrency: int, args) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    prompts = PROMPTS[: args.prompts] * args.repeat
    async with httpx.AsyncClient(timeout=None) as client:  # no client timeout: the adaptive deadline applies

        async def limited(p: str) -> dict:
            async with sem:
                return await one(client, url, p, args)

        return list(await asyncio.gather(*[limited(p) for p in prompts]))


def run_phase(url: str, phase: str, args) -> list[dict]:
    recs = []
    for mode, conc in (("sequential", 1), (f"concurrent-{args.concurrency}", args.concurrency)):
        t0 = time.monotonic()
        got = asyncio.run(run_suite(url, conc, args))
        for r in got:
            r.update(phase=phase, mode=mode)
        bad = [r for r in got if r["status"] != 200]
        print(
            f"{phase:8s} {mode:14s} {len(got)} requests in {time.monotonic() - t0:6.1f} s, "
            f"{len(bad)} not 200, load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        recs += got
    return recs


def summarise(recs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r["phase"], r["mode"]), []).append(r)
    out = []
    for (phase, mode), rs in groups.items():
        lat = [r["latency_s"] for r in rs if r["status"] == 200]
        out.append(
            {
                "phase": phase,
                "mode": mode,
                "n": len(rs),
                "ok": sum(r["status"] == 200 for r in rs),
                "504": sum(r["status"] == 504 for r in rs),
                "other": sum(r["status"] not in (200, 504) for r in rs),
                "p50_s": percentile(lat, 50),
                "max_s": max(lat) if lat else None,
                "all_latencies_s": [round(r["latency_s"], 2) for r in rs],
            }
        )
    return out


def report(summary: list[dict], recs: list[dict]) -> None:
    print_table(
        ["phase", "mode", "n", "200", "504", "other", "p50 s (200s)", "max s (200s)"],
        [[s["phase"], s["mode"], s["n"], s["ok"], s["504"], s["other"], s["p50_s"], s["max_s"]] for s in summary],
    )
    for s in summary:
        print(f"{s['phase']} {s['mode']} latencies (s, in order sent): {s['all_latencies_s']}")
    for r in recs:
        if r["status"] != 200:
            print(f"  {r['phase']} {r['mode']}: {r['status']} after {r['latency_s']:.1f} s: {r.get('error')}")
    hog = [r for r in recs if r["phase"] == "hogs"]
    print(
        f"with hogs: {sum(r['status'] == 504 for r in hog)} x 504, "
        f"{sum(r['status'] not in (200, 504) for r in hog)} other errors, of {len(hog)} (goal: 0 and 0)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hogs", type=int, default=3, help="CPU-bound processes beside the cluster")
    ap.add_argument("--hog-nice", type=int, default=0, help="niceness of the hogs (0 = as the cluster)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--repeat", type=int, default=1, help="send the suite this many times per mode")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--allow-eos", action="store_true", help="let a request stop at EOS (default: ignore_eos)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests at once in the concurrent mode")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    run_id = stamp()
    log = args.out / f"cpu_contention-{run_id}-conveyor.log"
    hogs: list[subprocess.Popen] = []
    with ConveyorUp(log, workers=args.workers) as c:
        try:
            warm = asyncio.run(run_suite(c.url, 1, argparse.Namespace(**{**vars(args), "prompts": 1, "repeat": 1})))
            print(f"warm-up (not counted): {warm[0]['status']} in {warm[0]['latency_s']:.1f} s", flush=True)
            recs = run_phase(c.url, "baseline", args)
            hogs = start_hogs(args.hogs, args.hog_nice)
            time.sleep(2)  # the hogs are up and spinning before the first request
            recs += run_phase(c.url, "hogs", args)
        finally:
            stop_hogs(hogs)
    summary = summarise(recs)
    report(summary, recs)
    logs = log_summary(log)
    print(f"cluster log: {logs['lines']} ERROR/WARNING lines; most frequent: {logs['top'][:5]}")
    path = write_json(
        args.out,
        "cpu_contention",
        {"args": vars(args), "summary": summary, "requests": recs, "server_log": logs, "warm_up": warm},
        run_id,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
