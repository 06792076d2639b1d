"""The ended-contexts cap under sustained load (issue 24, item 1): the same load with the cap far above and far
below what the run ends, throughput and latency side by side, as ratios (low / high).

Runs one after the other (--rounds of each cap, alternated), each on a fresh `conveyor up --engine sim --workers
N` (its own Redis): CONVEYOR_MAX_ENDED_CONTEXTS far above what the run ends (--cap-high), or far below
(--cap-low). Before the load,
--backlog ended contexts are written straight into Redis (by the gateway's creation script and the lifecycle's
transition script, as an hour of traffic leaves them; their creation events go to a sink, not the tokenizer):
with the low cap, the janitor's sweeps during the load delete them, as each 10 s sweep would at 1,000 req/s,
besides the run's own endings beyond the cap.

The load is an open loop: a ticket every 1/--rate s for --duration s, each taken by one of --connections
keep-alive connections, its latency counted from its ticket (a stalled scheduler shows as waiting here). Greedy
streamed /v1/completions of --max-tokens tokens, every stream checked as benchmarks/scale/control_plane.py checks
(status 200, final event and [DONE], the token count, the simulator's exact text). Prints per run: requests ok /
failed, throughput, latency p50 / p99 / max, the ended contexts before and after; then, over each cap's runs
pooled, the same figures side by side and their ratios. Writes JSON and each cluster's log into --out.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.cluster.janitor_cap [--rate 150] [--duration 60]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

import redis

from benchmarks.common import (
    DEFAULT_OUT,
    MODEL_NAME,
    ConveyorUp,
    fmt,
    log_summary,
    percentile,
    print_table,
    raise_fd_limit,
    stamp,
    write_json,
)
from benchmarks.scale.control_plane import expected_texts, prompts
from benchmarks.scale.sse_client import Connection, StreamRecord, check, request_body
from shared.wire.constants import Names
from shared.state.context_store import ContextStore
from shared.wire.events import RequestReceived, Sampling
from shared.state.lifecycle import TERMINAL, Lifecycle, State

CLUSTER_ENV = {
    "CONVEYOR_SIM_SPEEDUP": "100",  # steps of a few ms: the control plane, not the modelled device, is measured
    "CONVEYOR_MAX_NUM_SEQS": "1024",
    "CONVEYOR_MAX_OPEN_REQUESTS": "10000",  # admission limits above the load: a stall shows as latency, not 429s
    "CONVEYOR_MAX_WAITING_REQUESTS": "10000",
}


def write_backlog(url: str, n: int) -> float:
    """n ended (CANCELLED) contexts of the default namespace, in pipelines of 500; returns the seconds it took."""
    r, names, t0 = redis.Redis.from_url(url), Names(), time.perf_counter()
    store, lc = ContextStore(r, names, 3600), Lifecycle(r, names, "bench", 3600)
    sink = f"{names.ns}:bench:janitor-sink"  # not the received stream: no tokenizer sees these
    for start in range(0, n, 500):
        pipe = r.pipeline(transaction=False)
        rids = [uuid.uuid4().hex for _ in range(min(500, n - start))]
        for rid in rids:
            ev = RequestReceived(
                request_id=rid, reply_to="x", prompt="p", sampling=Sampling(max_tokens=1), deadline=0, received_at=0
            )
            keys, argv = store.create_args(rid, {"priority": 0}, {"prompt": "p"}, ev, stream=sink)
            store._create(keys=keys, args=argv, client=pipe)
        for rid in rids:
            lc.queue(pipe, rid, State.CANCELLED, "bench")
        pipe.execute()
    r.delete(sink)
    r.close()
    return time.perf_counter() - t0


def redis_figures(url: str) -> dict:
    r, names = redis.Redis.from_url(url), Names()
    try:
        return {
            "ended": sum(r.zcard(names.state_set(0, s.value)) for s in TERMINAL),
            "keys": r.dbsize(),
            "used_memory": r.info("memory")["used_memory"],
        }
    finally:
        r.close()


async def open_loop(port: int, args, texts: list[str]) -> list[StreamRecord]:
    tickets: asyncio.Queue = asyncio.Queue()
    records: list[StreamRecord] = []

    async def connection() -> None:
        conn = Connection("127.0.0.1", port)
        while (ticket := await tickets.get()) is not None:
            i, at = ticket
            path, body = request_body("completions", MODEL_NAME, texts[i % len(texts)], args.max_tokens)
            records.append(await conn.stream(path, body, "completions", StreamRecord(i % len(texts), at)))
        conn.close()

    tasks = [asyncio.create_task(connection()) for _ in range(args.connections)]
    t0, n = time.perf_counter(), int(args.rate * args.duration)
    for i in range(n):  # the ticket's time is when it was due: waiting for a connection counts
        await asyncio.sleep(max(0.0, t0 + i / args.rate - time.perf_counter()))
        tickets.put_nowait((i, t0 + i / args.rate))
    for _ in tasks:
        tickets.put_nowait(None)
    await asyncio.gather(*tasks)
    return records


def figures(recs: list[StreamRecord], expected: list[str], args, wall_s: float) -> dict:
    failures: dict[str, int] = {}
    ok = []
    for r in recs:
        why = check(r, expected[r.prompt_i], args.max_tokens)
        if why:
            failures[why[:120]] = failures.get(why[:120], 0) + 1
        else:
            ok.append(r)
    lat = [(r.t_end - r.t_start) * 1000 for r in ok]  # ms
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    return {
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "failures": failures,
        "wall_s": wall_s,
        "throughput": len(ok) / wall_s,
        "latency_p50": percentile(lat, 50),
        "latency_p99": percentile(lat, 99),
        "latency_max": max(lat, default=None),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
    }


def one_run(cap: int, args, texts: list[str], expected: list[str], name: str) -> tuple[list[StreamRecord], dict]:
    env = {**CLUSTER_ENV, "CONVEYOR_MAX_ENDED_CONTEXTS": str(cap)}
    log = args.out / f"{name}-conveyor.log"
    with ConveyorUp(log, workers=args.workers, env=env, args=["--engine", "sim"]) as cluster:
        url = cluster.find_redis_url()
        backlog_s = write_backlog(url, args.backlog)
        before = redis_figures(url)
        t0 = time.perf_counter()
        recs = asyncio.run(open_loop(cluster.port, args, texts))
        fig = figures(recs, expected, args, time.perf_counter() - t0)
        time.sleep(args.settle)  # one more sweep interval: what the cap leaves once the run has ended
        fig.update(cap=cap, backlog_s=backlog_s, redis_before=before, redis_after=redis_figures(url))
    fig["server_log"] = log_summary(log)
    print(
        f"cap {cap}: {fig['ok']} ok, {fig['failed']} failed {fig['failures'] or ''}in {fig['wall_s']:.1f} s, "
        f"{fig['throughput']:.1f} req/s, latency ms p50 {fmt(fig['latency_p50'], 0)} p99 "
        f"{fmt(fig['latency_p99'], 0)} max {fmt(fig['latency_max'], 0)}; ended contexts {before['ended']} before "
        f"the load, {fig['redis_after']['ended']} after",
        flush=True,
    )
    return recs, fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=150, help="requests sent per second")
    ap.add_argument("--duration", type=float, default=60, help="seconds of load per run")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backlog", type=int, default=20_000, help="ended contexts written before the load")
    ap.add_argument("--cap-high", type=int, default=10_000_000)
    ap.add_argument("--cap-low", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each cap, alternated")
    ap.add_argument("--settle", type=float, default=12, help="seconds after the load before the last Redis read")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    raise_fd_limit()
    args.out.mkdir(parents=True, exist_ok=True)
    run_id, texts = stamp(), prompts(512)
    expected = expected_texts("completions", texts, args.max_tokens)
    print(
        f"janitor cap: {args.rate:.0f} req/s for {args.duration:.0f} s, {args.max_tokens} tokens, {args.workers} "
        f"sim workers, backlog {args.backlog}, caps {args.cap_high} / {args.cap_low}",
        flush=True,
    )
    runs: dict[int, list] = {args.cap_high: [], args.cap_low: []}
    for r in range(args.rounds):  # alternated: a machine that gets busier later weighs on both caps alike
        for cap, got in runs.items():
            got.append(one_run(cap, args, texts, expected, f"janitor_cap-{run_id}-cap{cap}-{r}"))
    pooled = {
        cap: figures([rec for recs, _ in got for rec in recs], expected, args, sum(f["wall_s"] for _, f in got))
        for cap, got in runs.items()
    }
    high, low = pooled[args.cap_high], pooled[args.cap_low]
    keys = ["ok", "failed", "throughput", "latency_p50", "latency_p99", "latency_max", "ttft_p50", "ttft_p99"]  # ms
    ratio = {k: (low[k] / high[k] if high[k] else None) for k in keys[2:]}
    left = {cap: max(f["redis_after"]["ended"] for _, f in got) for cap, got in runs.items()}
    print_table(
        ["", f"cap {args.cap_high}", f"cap {args.cap_low}", "low / high"],
        [[k, high[k], low[k], ratio.get(k)] for k in keys]
        + [["ended contexts after (most)", left[args.cap_high], left[args.cap_low], None]],
    )
    data = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "env": CLUSTER_ENV,
        "pooled": pooled,
        "ratio": ratio,
        "runs": {cap: [f for _, f in got] for cap, got in runs.items()},
    }
    path = write_json(args.out, "janitor_cap", data, run_id)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
