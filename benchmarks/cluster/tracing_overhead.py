"""Tracing overhead: cluster throughput at 16 concurrent requests, tracing exported vs off, in one run.

Two local clusters run side by side (one worker each): one exports every span over OTLP/HTTP to a
real receiver (tests/support/otlp_receiver.py, in a process of its own, decoding every export), the other
has no endpoint (the no-op tracer). Rounds alternate between them (A B B A ...), so drift of a shared
machine hits both alike; each round sends `--requests` greedy requests (ignore_eos, `--max-tokens` each)
with 16 in flight.
Prints output tokens/s per round, the median of each and their gap, and the CPU seconds the services
spent per 1000 tokens, in all and per service (from /proc: what tracing costs each service does not
drift with a busy shared machine the way wall-clock throughput does). The receiver runs niced: in a
deployment the collector is elsewhere.
Run: .venv/bin/python -m benchmarks.cluster.tracing_overhead  [--rounds 6] [--requests 32] [--max-tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import PROMPTS
from tests.support.cluster import Cluster
from tests.support.cache import CACHE_DIR
from tests.support.otlp_receiver import OtlpReceiver


SETTLE_S = 2.5  # > the batch span processor's export interval (CONVEYOR_OTEL_SCHEDULE_DELAY_MS, 2 s)


def _receive(port_out, spans) -> None:
    """The OTLP receiver, in a process of its own (its decoding never holds the client's GIL), at the lowest
    CPU priority: in a deployment the collector runs elsewhere, so its decoding must not slow the services."""
    os.nice(19)
    receiver = OtlpReceiver().start()
    port_out.put(receiver.port)
    while True:
        time.sleep(0.2)
        spans.value = len(receiver.spans)


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """User + system CPU time of each service process of the cluster so far (Linux /proc)."""
    out = {}
    for name, p in cluster.procs.items():
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return out


def start_receiver():
    port_out, spans = multiprocessing.Queue(), multiprocessing.Value("q", 0)
    proc = multiprocessing.Process(target=_receive, args=(port_out, spans), daemon=True)
    proc.start()
    return proc, f"http://127.0.0.1:{port_out.get(timeout=30)}", spans


async def one_round(url: str, n: int, max_tokens: int, concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> int:
            async with sem:
                r = await client.post(
                    f"{url}/generate",
                    json={
                        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(i) for i in range(n)]))
        return time.perf_counter() - t0, tokens


def measure(clusters: dict, args) -> tuple[dict, dict]:
    """Alternating rounds; returns tok/s and service CPU seconds per 1000 tokens, per mode."""
    for c in clusters.values():  # warm-up: first requests pay one-off costs
        asyncio.run(one_round(c.url, args.concurrency, 8, args.concurrency))
    rates: dict[str, list[float]] = {name: [] for name in clusters}
    cpu: dict[str, list[float]] = {name: [] for name in clusters}
    per_service: dict[str, dict[str, list[float]]] = {name: {} for name in clusters}
    for i in range(args.rounds):
        for name in ["traced", "off"] if i % 2 == 0 else ["off", "traced"]:
            cpu0 = cpu_seconds(clusters[name])
            dt, tokens = asyncio.run(one_round(clusters[name].url, args.requests, args.max_tokens, args.concurrency))
            time.sleep(SETTLE_S)  # the round's last span batch is exported (and counted) before the next round
            rates[name].append(tokens / dt)
            cpu1 = cpu_seconds(clusters[name])
            used = {svc: (cpu1[svc] - cpu0.get(svc, 0.0)) / tokens * 1000 for svc in cpu1}
            cpu[name].append(sum(used.values()))
            for svc, v in used.items():
                per_service[name].setdefault(svc, []).append(v)
            print(
                f"round {i} {name:7s} {tokens} tokens in {dt:6.2f} s = {tokens / dt:7.1f} tok/s, "
                f"{cpu[name][-1]:.2f} CPU s per 1000 tokens",
                flush=True,
            )
    return rates, cpu, per_service


def report(rates: dict, cpu: dict, per_service: dict, spans: int) -> dict:
    med = {name: statistics.median(v) for name, v in rates.items()}
    gap = (med["off"] - med["traced"]) / med["off"] * 100
    # Each round pairs the two modes back to back: the paired ratio cancels most of the machine's drift.
    paired = (1 - statistics.median(t / o for t, o in zip(rates["traced"], rates["off"]))) * 100
    print(
        f"median tok/s: traced {med['traced']:.1f}, off {med['off']:.1f}; traced is {gap:+.2f}% slower "
        f"(median of paired rounds: {paired:+.2f}%); {spans} spans received"
    )
    cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
    cpu_gap = (cpu_med["traced"] - cpu_med["off"]) / cpu_med["off"] * 100
    print(
        f"median service CPU s per 1000 tokens: traced {cpu_med['traced']:.3f}, off {cpu_med['off']:.3f} "
        f"({cpu_gap:+.2f}%)"
    )
    svc_med = {mode: {svc: statistics.median(v) for svc, v in d.items()} for mode, d in per_service.items()}
    for svc in svc_med["off"]:
        t, o = svc_med["traced"].get(svc, 0.0), svc_med["off"][svc]
        print(f"  {svc:10s} CPU s per 1000 tokens: traced {t:.3f}, off {o:.3f}")
    return {
        "rates": rates,
        "median": med,
        "gap_percent": gap,
        "paired_gap_percent": paired,
        "spans": spans,
        "cpu_per_1000_tokens": cpu,
        "cpu_gap_percent": cpu_gap,
        "cpu_per_service_median": svc_med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per mode")
    ap.add_argument("--requests", type=int, default=32, help="requests per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    receiver, endpoint, spans = start_receiver()
    tmp = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    env_on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    env_off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "CONVEYOR_OTLP_ENDPOINT": ""}
    clusters = {
        "traced": Cluster(tmp / "on", CACHE_DIR, env=env_on),
        "off": Cluster(tmp / "off", CACHE_DIR, env=env_off),
    }
    try:
        for c in clusters.values():
            c.tmp.mkdir(parents=True, exist_ok=True)
            c.start()
        rates, cpu, per_service = measure(clusters, args)
        time.sleep(1.0)  # let the last spans arrive
    finally:
        for c in clusters.values():
            c.stop()
        time.sleep(0.5)
        receiver.terminate()
    out = report(rates, cpu, per_service, spans.value)
    if args.json:
        args.json.write_text(json.dumps({**out, "args": vars(args)}, default=str, indent=1))


if __name__ == "__main__":
    main()
