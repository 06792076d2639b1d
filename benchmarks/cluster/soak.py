"""Soak: mixed load on a `conveyor up` cluster for 10 minutes; are Redis memory and gateway RSS flat?

`conveyor up --workers 1` on a redis-server this benchmark starts (as the launcher would: AOF on, no RDB), so its
URL is known. --clients loops each send one request after another, chosen at random (seeded) by --mix:
  json        non-streaming: /generate, /v1/completions or /v1/chat/completions
  stream      streamed to the end: /generate or /v1/chat/completions
  disconnect  /generate streamed, the client closes the connection after 0-3 events (0 = while queued)
  cancel      /generate streamed, DELETE /v1/requests/{X-Request-Id} after 0-2 events, then read to the end
with short max_tokens (--tokens) so many requests complete. Every --interval seconds it samples Redis used_memory
and DBSIZE (INFO memory) and the RSS of every process of the cluster (gateway, tokenizer, scheduler, worker,
redis). After the load it drains the clients, then idles --settle seconds (still sampling).
Prints, per metric, the value after warm-up (--warmup of the run) and at the end of the load, the least-squares
slope per minute after warm-up, and the value after idling; and the requests by kind and outcome. Writes JSON
and a PNG (Redis memory and gateway RSS over time) into --out.
The latency of every request ended in an interval gives that interval's p50/p99 (the third plot). With --engine sim
and --max-ended-contexts below rate x --context-ttl, it is the long run of issue 24: the control plane at the
highest rate simulated workers sustain, the ended-contexts cap reached and enforced throughout.
Run: .venv/bin/python -m benchmarks.cluster.soak [--duration 600] [--clients 16] [--engine sim] [--max-ended-contexts N]
     [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from benchmarks.common import (
    DEFAULT_OUT,
    MODEL_NAME,
    ConveyorUp,
    log_summary,
    percentile,
    key_census,
    redis_memory,
    rss_by_role,
    stamp,
    write_json,
)
from benchmarks.cluster.soak_report import analyse, plot, report
from shared.redis_io.redis_server import RedisServer
from shared.settings import CommonSettings

NAMES = CommonSettings().names()  # the cluster's keys: the default namespace, as `conveyor up` uses
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Tell me a fun fact about octopuses.",
    "Why is the sky blue?",
    "Give three tips for a job interview.",
]


def parse_mix(text: str) -> dict[str, float]:
    mix = {k: float(v) for k, v in (part.split("=") for part in text.split(","))}
    unknown = set(mix) - {"json", "stream", "disconnect", "cancel"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kinds in --mix: {sorted(unknown)}")
    return mix


def request_for(path: str, rng: random.Random, args, stream: bool) -> dict:
    prompt, n = rng.choice(PROMPTS), rng.randint(*args.tokens)
    body = {"max_tokens": n, "temperature": rng.choice([0, 0.8]), "stream": stream}
    if path == "/v1/chat/completions":
        return {**body, "model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}
    if path == "/v1/completions":
        return {**body, "model": MODEL_NAME, "prompt": prompt}
    return {**body, "messages": [{"role": "user", "content": prompt}]}


def final_outcome(event: dict, outcome: str | None) -> str | None:
    """The outcome an SSE event settles: an error event (native or OpenAI shape) or a finish_reason."""
    if "error" in event:
        return f"error:{event['error'].get('code')}"
    choices = event.get("choices") or [{}]
    if event.get("finish_reason") or choices[0].get("finish_reason"):
        return "ok"
    return outcome


class Load:
    def __init__(self, url: str, args):
        self.url, self.args = url, args
        self.outcomes: Counter = Counter()
        self.stopping = asyncio.Event()
        self.latencies: list[float] = []  # seconds of each request ended since the last sample (sampler empties it)

    async def client_loop(self, client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds, weights = zip(*self.args.mix.items())
        while not self.stopping.is_set():
            kind = rng.choices(kinds, weights)[0]
            started = time.monotonic()
            try:
                outcome = await getattr(self, kind)(client, rng)
                self.latencies.append(time.monotonic() - started)
            except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
                outcome = f"exception:{type(e).__name__}"
                await asyncio.sleep(0.5)  # a cluster that refuses everything must not be hammered in a tight loop
            self.outcomes[f"{kind} {outcome}"] += 1

    async def json(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        path = rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
        r = await client.post(self.url + path, json=request_for(path, rng, self.args, False))
        return "ok" if r.status_code == 200 else f"http_{r.status_code}"

    async def stream(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        path = rng.choice(["/generate", "/v1/chat/completions"])
        async with client.stream("POST", self.url + path, json=request_for(path, rng, self.args, True)) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            return await self.read_to_end(r.aiter_lines())

    def generate_stream(self, client: httpx.AsyncClient, rng: random.Random):
        return client.stream("POST", self.url + "/generate", json=request_for("/generate", rng, self.args, True))

    async def disconnect(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        after = rng.randint(0, 3)
        async with self.generate_stream(client, rng) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            lines = r.aiter_lines()  # leaving the block after `after` events closes the connection mid-stream
            return "ended_first" if await skip_events(lines, after) else "disconnected"

    async def cancel(self, client: httpx.AsyncClient, rng: random.Random) -> str:
        after = rng.randint(0, 2)
        async with self.generate_stream(client, rng) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            lines = r.aiter_lines()
            if await skip_events(lines, after):
                return "ended_first"
            d = await client.delete(f"{self.url}/v1/requests/{r.headers['x-request-id']}")
            outcome = await self.read_to_end(lines)
            return outcome if d.status_code == 200 else f"delete_http_{d.status_code} {outcome}"

    async def read_to_end(self, lines) -> str:
        outcome = None
        while (event := await next_event(lines)) is not None:
            outcome = final_outcome(event, outcome)
        return outcome or "no_final_event"


async def next_event(lines) -> dict | None:
    """The next SSE data event, or None at [DONE] or the end of the stream."""
    async for line in lines:
        if line.startswith("data: "):
            return None if line == "data: [DONE]" else json.loads(line[6:])
    return None


async def skip_events(lines, n: int) -> bool:
    """Read n events; True if the stream ended (or reached its final event) first."""
    for _ in range(n):
        event = await next_event(lines)
        if event is None or final_outcome(event, None):
            return True
    return False


def take_sample(
    cluster: ConveyorUp, redis_srv: RedisServer, t0: float, phase: str, done: int, latencies: list[float] | None = None
) -> dict:
    procs = cluster.processes()
    procs["redis"] = psutil.Process(redis_srv.proc.pid)
    sample = {"t_s": time.monotonic() - t0, "phase": phase, "requests_done": done, "rss": rss_by_role(procs)}
    if latencies:  # the requests that ended since the last sample
        sample["latency"] = {
            "p50_s": percentile(latencies, 50),
            "p99_s": percentile(latencies, 99),
            "n": len(latencies),
        }
    try:
        sample["redis"] = redis_memory(redis_srv.url)
        sample["census"] = key_census(redis_srv.url, NAMES)
    except Exception as e:  # noqa: BLE001 - a failed sample is recorded, the soak goes on
        sample["redis_error"] = repr(e)
    return sample


async def sampler(cluster, redis_srv, load: Load, state: dict, samples: list, interval: float, seed: int) -> None:
    """One sample in each interval of a grid from t0 (no drift), at a random point of it: the cluster's own periodic
    work (the janitor's 10 s sweeps: ended contexts run from the cap to the cap + 10 s of endings between two) would
    otherwise be seen at one phase, drifting slowly, and a phase's wrap read as a step (docs/benchmarks.md, issue 29)."""
    t0, rng, k = state["t0"], random.Random(seed), 0
    while True:
        ended, load.latencies = load.latencies, []
        s = await asyncio.to_thread(
            take_sample, cluster, redis_srv, t0, state["phase"], sum(load.outcomes.values()), ended
        )
        samples.append(s)
        k, at = next_sample(k, time.monotonic() - t0, interval, rng)
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))


def next_sample(k: int, elapsed: float, interval: float, rng: random.Random) -> tuple[int, float]:
    """After the sample of interval k, taken with `elapsed` seconds gone: the next interval not yet over, and the
    time (from t0) of its sample, at a random point of it (at once where that point has passed)."""
    k = max(k + 1, int(elapsed // interval))
    return k, max(elapsed, (k + rng.random()) * interval)


async def soak(cluster: ConveyorUp, redis_srv: RedisServer, args) -> tuple[list[dict], Counter]:
    load, samples = Load(cluster.url, args), []
    state = {"t0": time.monotonic(), "phase": "load"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        sampling = asyncio.create_task(sampler(cluster, redis_srv, load, state, samples, args.interval, args.seed))
        clients = [asyncio.create_task(load.client_loop(client, i)) for i in range(args.clients)]
        await asyncio.sleep(args.duration)
        load.stopping.set()  # no new requests; the ones in flight finish (short max_tokens)
        samples.append(take_sample(cluster, redis_srv, state["t0"], "end", sum(load.outcomes.values())))
        state["phase"] = "drain"
        _, pending = await asyncio.wait(clients, timeout=120)
        for t in pending:
            t.cancel()
        state["phase"] = "idle"
        await asyncio.sleep(args.settle)
        samples.append(take_sample(cluster, redis_srv, state["t0"], "idle-end", sum(load.outcomes.values())))
        sampling.cancel()
    return sorted(samples, key=lambda s: s["t_s"]), load.outcomes


def cluster_env(args) -> dict:
    env = {
        "CONVEYOR_CONTEXT_TTL_S": str(args.context_ttl),
        "CONVEYOR_ENGINE": args.engine,
        "CONVEYOR_SIM_SPEEDUP": str(args.sim_speedup),
    }
    if args.max_ended_contexts is not None:
        env["CONVEYOR_MAX_ENDED_CONTEXTS"] = str(args.max_ended_contexts)
    return env


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--clients", type=int, default=16, help="concurrent client loops")
    ap.add_argument("--mix", type=parse_mix, default=parse_mix("json=35,stream=30,disconnect=15,cancel=20"))
    ap.add_argument("--tokens", type=int, nargs=2, default=[4, 24], metavar=("MIN", "MAX"), help="max_tokens range")
    ap.add_argument("--interval", type=float, default=5, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of --duration counted as warm-up")
    ap.add_argument("--settle", type=float, default=15, help="seconds to idle after the load, still sampling")
    ap.add_argument(
        "--context-ttl",
        type=int,
        default=120,
        help="CONVEYOR_CONTEXT_TTL_S of the cluster: ended contexts stay this long, so Redis holds "
        "about rate x TTL of them; the default lets a 10-minute soak reach its steady state",
    )
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--engine",
        choices=("torch", "sim"),
        default="torch",
        help="the workers' engine: sim (CONVEYOR_ENGINE=sim) for the control plane at its highest rate",
    )
    ap.add_argument(
        "--sim-speedup",
        type=float,
        default=1.0,
        help="CONVEYOR_SIM_SPEEDUP with --engine sim: steps that many times shorter than the model's, so the "
        "control plane, not the simulated model, is what limits the rate",
    )
    ap.add_argument(
        "--max-ended-contexts",
        type=int,
        default=None,
        help="CONVEYOR_MAX_ENDED_CONTEXTS of the cluster: set below rate x --context-ttl, the janitor's cap "
        "path deletes contexts throughout the run",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    run_id = stamp()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"soak-{run_id}-conveyor.log"
    redis_srv = RedisServer(Path(tempfile.mkdtemp(prefix="soak-redis-")), appendonly=True).start()
    try:
        with ConveyorUp(log, workers=args.workers, redis_url=redis_srv.url, env=cluster_env(args)) as cluster:
            samples, outcomes = asyncio.run(soak(cluster, redis_srv, args))
    finally:
        redis_srv.stop()
    stats = analyse(samples, args)
    report(stats, outcomes)
    logs = log_summary(log)
    print(f"cluster log: {logs['lines']} ERROR/WARNING lines; most frequent: {logs['top'][:5]}")
    png = plot(samples, args, args.out / f"soak-{run_id}.png")
    path = write_json(
        args.out,
        "soak",
        {
            "args": vars(args),
            "stats": stats,
            "outcomes": dict(outcomes),
            "samples": samples,
            "server_log": logs,
            "png": png,
        },
        run_id,
    )
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
