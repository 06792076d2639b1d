"""Control plane at scale: 4 simulated workers, concurrent streaming clients ramped 100 -> 1,000 -> 5,000.

`conveyor up --engine sim --workers 4` (gateway, tokenizer, scheduler, Redis exactly as in production; only the
forward pass is modelled, docs/simulated_engine.md). At each level N, N client loops each open a keep-alive
connection and stream greedy requests (short prompts, --max-tokens output tokens) one after another until
--duration has passed (at least one each), all N at once. Every stream is checked: status 200, a final event
and [DONE], max_tokens tokens, and text equal to the simulator's deterministic sequence for its prompt (a lost,
repeated or reordered token changes it; /generate also checks its token indices are contiguous).

Per level: TTFT and ITL seen by the client, the engine's own (the modelled time of the steps that made the
tokens, from the workers' step logs: CONVEYOR_SIM_STEP_LOG_DIR) and the difference (added by the pipeline);
tokens/s delivered; CPU seconds per 1,000 tokens of each service's process tree and of this client (psutil,
before/after); Redis commands per token (INFO commandstats delta); Redis memory and every service's RSS
(after the level, and the peak sampled each second during it); /health latency from a separate process while
the streams are open. The client is one asyncio process on the same 2-core machine as the cluster.
Writes JSON (and with --plots, one PNG per metric) into --out.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.scale.control_plane [--levels 100 1000 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchmarks.scale import control_plane_measure as m
from benchmarks.common import (
    DEFAULT_OUT,
    MODEL_NAME,
    ConveyorUp,
    log_summary,
    model_dir,
    percentile,
    raise_fd_limit,
    stamp,
    write_json,
)
from benchmarks.scale.sse_client import Connection, StreamRecord, check, request_body

# Chosen so that the engine is never the bottleneck (docs/benchmarks.md explains each).
CLUSTER_ENV = {
    "CONVEYOR_SIM_SPEEDUP": "100",  # a device 100x this CPU: a decode step of 1,250 sequences models ~22 ms
    "CONVEYOR_MAX_NUM_SEQS": "2048",  # every stream of 5,000 on 4 workers runs at once, with room for imbalance
    "CONVEYOR_MAX_NUM_BATCHED_TOKENS": "65536",  # a burst of prompts is prefilled in one step, not queued
    "CONVEYOR_KV_CACHE_BYTES": str(8 << 30),  # 11,650 blocks a worker (only counted: a sim pool holds nothing)
    "CONVEYOR_MAX_OPEN_REQUESTS": "10000",  # admission limits above the load: measure the pipeline, not 429s
    "CONVEYOR_MAX_WAITING_REQUESTS": "10000",
}
SUBJECTS = ["cat", "river", "mountain", "violin", "garden", "comet", "lantern", "harbour"]
SERVICES = ["gateway", "tokenizer", "scheduler", "worker", "redis", "launcher", "client"]


def prompts(n: int) -> list[str]:
    """Short, distinct prompts (7-12 tokens: no full KV block, so no prefix-cache hit between them)."""
    return [f"Request {i}: write about a {SUBJECTS[i % len(SUBJECTS)]}." for i in range(n)]


def expected_texts(api: str, texts: list[str], max_tokens: int) -> list[str]:
    """What the simulator answers each prompt, greedy: its token ids are a function of the prompt's ids alone."""
    from services.tokenizer.service import Preprocessor
    from services.worker.engine.sim.sim_model import load_vocab, sequence_key
    from shared.wire.events import ChatMessage, RequestReceived, Sampling
    from shared.text.tokenization import load_tokenizer, model_info

    info = model_info(model_dir())
    pre, vocab = Preprocessor(load_tokenizer(info.model_dir), info.max_len), load_vocab(info.model_dir)
    out = []
    for text in texts:
        chat = (ChatMessage("user", text),) if api == "chat" else None
        ev = RequestReceived(
            request_id="x",
            reply_to="x",
            prompt=None if chat else text,
            messages=chat,
            sampling=Sampling(max_tokens=max_tokens),
            deadline=0,
            received_at=0,
        )
        key = sequence_key(pre.token_ids(ev), 0)  # greedy: seed 0
        ids = [vocab.next_token(key, i, frozenset(), True, 0.0) for i in range(max_tokens)]
        out.append(pre.tok.decode(ids))
    return out


async def client_loop(i: int, port: int, stop_at: float, args, texts: list[str]) -> list[StreamRecord]:
    conn, recs, k = Connection("127.0.0.1", port), [], 0
    loop = asyncio.get_running_loop()
    while True:
        p = (i * 7919 + k) % len(texts)
        path, body = request_body(args.api, MODEL_NAME, texts[p], args.max_tokens)
        recs.append(await conn.stream(path, body, args.api, StreamRecord(p, time.perf_counter())))
        k += 1
        if loop.time() >= stop_at or recs[-1].error:
            break
    conn.close()
    return recs


async def run_clients(n: int, port: int, args, texts: list[str]) -> tuple[list[StreamRecord], float, float]:
    t0 = time.time()
    stop_at = asyncio.get_running_loop().time() + args.duration
    per_client = await asyncio.gather(*[client_loop(i, port, stop_at, args, texts) for i in range(n)])
    return [r for recs in per_client for r in recs], t0, time.time()


def client_figures(recs: list[StreamRecord], expected: list[str], args) -> dict:
    failures = {}
    for r in recs:
        why = check(r, expected[r.prompt_i], args.max_tokens)
        if why:
            failures[why[:120]] = failures.get(why[:120], 0) + 1
    ok = [r for r in recs if not check(r, expected[r.prompt_i], args.max_tokens)]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]  # between events with text (an event may carry several tokens)
    tpot = [sum(r.gaps) / (args.max_tokens - 1) for r in ok if args.max_tokens > 1]  # per token, first to last
    return {
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "failures": failures,
        "tokens": sum(r.completion_tokens or 0 for r in ok),
        "events": sum(len(r.text) for r in recs),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
    }


def level_figures(
    n: int, recs, t0: float, t1: float, before: dict, after: dict, cluster_probe, args, expected: list[str]
) -> dict:
    sampler, probe, steps_dir = cluster_probe
    c = client_figures(recs, expected, args)
    eng = m.engine_own(m.read_steps(steps_dir, t0, t1))
    tokens = max(1, c["tokens"])
    cpu = m.delta(after["cpu"], before["cpu"])
    cmds = m.delta(after["commands"], before["commands"])
    health = probe.between(t0, t1)
    lat = [h[1] for h in health if h[1] is not None]
    eng.update(tpot_p50=eng["itl_p50"], tpot_p99=eng["itl_p99"])  # the engine gives a token per step
    added = {
        f"{k}_added_{p}": (c[f"{k}_{p}"] - eng[f"{k}_{p}"])
        if c[f"{k}_{p}"] is not None and eng[f"{k}_{p}"] is not None
        else None
        for k in ("ttft", "itl", "tpot")
        for p in ("p50", "p99")
    }
    return {
        "streams": n,
        "t0": t0,
        "t1": t1,
        "duration_s": t1 - t0,
        **c,
        "engine": eng,
        **added,
        "tokens_per_s": c["tokens"] / (t1 - t0),
        "cpu_s": cpu,
        "cpu_s_per_1k_tokens": {k: v / tokens * 1000 for k, v in cpu.items()},
        "redis_commands": sum(cmds.values()),
        "redis_commands_per_token": sum(cmds.values()) / tokens,
        "redis_top_commands": sorted(cmds.items(), key=lambda kv: -kv[1])[:10],
        "redis_nodes": m.node_figures(before, after, tokens),
        "redis_after": after["redis"],
        "rss_after": after["rss"],
        "peak": sampler.peak(t0, t1),
        "health": {
            "probes": len(health),
            "failed": len(health) - len(lat),
            "p50": percentile(lat, 50),
            "p99": percentile(lat, 99),
            "max": max(lat, default=None),
        },
    }


def run_levels(
    cluster: ConveyorUp,
    args,
    texts: list[str],
    expected: list[str],
    out: Path,
    run_id: str,
    target: m.RedisTarget | None = None,
) -> list:
    """Every level of args.levels on this cluster, one after the other; target: the Redis it runs on (default:
    the one redis-server `conveyor up` started or was given)."""
    target = target or m.RedisTarget.single(cluster.find_redis_url())
    sampler = m.Sampler(cluster, target)
    probe = m.HealthProbe("127.0.0.1", cluster.port, out / f"control_plane-{run_id}-health.jsonl", args.probe_s)
    results = []
    try:
        for n in args.levels:
            before = m.snapshot(cluster, target)
            recs, t0, t1 = asyncio.run(run_clients(n, cluster.port, args, texts))
            time.sleep(args.settle)  # let the services finish the level's last writes before the CPU snapshot
            after = m.snapshot(cluster, target)
            fig = level_figures(n, recs, t0, t1, before, after, (sampler, probe, args.steps_dir), args, expected)
            results.append(fig)
            print_level(fig)
        time.sleep(args.idle)
        results.append({"idle_after_s": args.idle, "rss": m.rss_by_service(cluster), "redis": target.memory()})
    finally:
        probe.stop()
        sampler.stop()
    return results


def print_level(f: dict) -> None:
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    print(
        f"\n== {f['streams']} streams: {f['requests']} requests, {f['ok']} ok, {f['failed']} failed "
        f"{f['failures'] or ''}in {f['duration_s']:.1f} s, {f['tokens_per_s']:.0f} tok/s",
        flush=True,
    )
    e = f["engine"]
    for k in ("ttft", "itl", "tpot"):
        print(
            f"  {k}: client p50 {ms(f[k + '_p50'])} / p99 {ms(f[k + '_p99'])} ms; engine's own p50 "
            f"{ms(e[k + '_p50'])} / p99 {ms(e[k + '_p99'])} ms; added p50 {ms(f[k + '_added_p50'])} / p99 "
            f"{ms(f[k + '_added_p99'])} ms"
        )
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(f["cpu_s_per_1k_tokens"].items()))
    print(f"  CPU s per 1k tokens: {cpu}")
    print(
        f"  Redis: {f['redis_commands_per_token']:.2f} commands/token (top {f['redis_top_commands'][:5]}), "
        f"used_memory {f['redis_after']['used_memory'] / 2**20:.1f} MiB, keys {f['redis_after']['keys']}"
    )
    for label, n in f["redis_nodes"].items():
        share = "" if n["share"] is None else f" ({n['share']:.0%} of the masters')"
        print(
            f"    {label} ({n['role']}): {n['commands_per_token']:.2f} commands/token{share}, CPU "
            f"{n['cpu_s_per_1k_tokens']:.3f} s per 1k tokens ({n['cpu_core_share']:.0%} of a core)"
        )
    rss = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(f["rss_after"].items()))
    print(f"  RSS MiB after: {rss}")
    print(f"  most requests in each state at once: {f['peak']['max_in_state']}")
    h = f["health"]
    print(
        f"  /health: {h['probes']} probes, {h['failed']} failed, p50 {ms(h['p50'])} p99 {ms(h['p99'])} "
        f"max {ms(h['max'])} ms",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--duration", type=float, default=20, help="seconds each client loop keeps sending")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api", choices=["completions", "chat", "generate"], default="completions")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=512, help="distinct prompts")
    ap.add_argument("--probe-s", type=float, default=0.2, help="seconds between /health probes")
    ap.add_argument("--settle", type=float, default=3, help="seconds after a level before its CPU snapshot")
    ap.add_argument("--idle", type=float, default=15, help="seconds idle after the last level (RSS after idle)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="extra CONVEYOR_* settings")
    ap.add_argument("--plots", action="store_true", help="one PNG per metric into --out")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    fds, run_id = raise_fd_limit(), stamp()
    args.out.mkdir(parents=True, exist_ok=True)
    args.steps_dir = args.out / f"control_plane-{run_id}-steps"
    env = {**CLUSTER_ENV, "CONVEYOR_SIM_STEP_LOG_DIR": str(args.steps_dir), **dict(s.split("=", 1) for s in args.set)}
    texts = prompts(args.prompts)
    expected = expected_texts(args.api, texts, args.max_tokens)
    print(
        f"control plane: levels {args.levels}, {args.duration:.0f} s each, {args.api}, {args.max_tokens} tokens, "
        f"{args.workers} sim workers, open files limit {fds}, settings {env}",
        flush=True,
    )
    log = args.out / f"control_plane-{run_id}-conveyor.log"
    with ConveyorUp(log, workers=args.workers, env=env, args=["--engine", "sim"]) as cluster:
        results = run_levels(cluster, args, texts, expected, args.out, run_id)
    data = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "levels": results[:-1],
        "idle": results[-1],
        "server_log": log_summary(log),
    }
    path = write_json(args.out, "control_plane", data, run_id)
    print(f"wrote {path}")
    if args.plots:
        from benchmarks.scale.control_plane_plots import plot_all

        print("plots:", [str(p) for p in plot_all(data, args.out, f"control-plane-{run_id}")])


if __name__ == "__main__":
    main()
