"""Gateway event loop under heavy payloads (issue 24, item 9): does a client's worst allowed request stall it?

A `conveyor up` cluster on simulated workers (CONVEYOR_ENGINE=sim, CONVEYOR_SIM_SPEEDUP high so 4096-token
outputs come in seconds). Each payload is sent --reps times, one at a time, while a probe process GETs /health
every 50 ms and reads the age of the gateway's liveness entry (shared/process/liveness.py, the `gateway` hash). Payloads:
  logprobs_json     chat, n=16, logprobs + top_logprobs=20, max_tokens=4096 (ignore_eos): ~120 MB of JSON
  logprobs_stream   the same, streamed
  tools_128         chat with 128 tools, ~1 MB (fresh schemas each time, so none is cached); 400 too_long from the
                    tokenizer (the tools do not fit SmolLM2's context), after the gateway compiled every schema
  stop_strings      chat, n=16, max_tokens=4096, 4 stop strings of 256 characters that never match, streamed
(A run of one repeated special token is not sent: the simulator emits plain words only.)
Per payload it prints the max and p99 /health latency while the payload ran, the liveness entry's max age (it is
refreshed every second, CONVEYOR_HEARTBEAT_INTERVAL_S; the scheduler takes a gateway whose entry is older than
CONVEYOR_LIVENESS_TTL_S, 5 s, for dead) and the payload's own time (send to last byte). --compare REF runs the same on the tree of git commit REF (extracted
with git archive) first and prints before / after.
Run (one benchmark at a time on a shared machine):
  flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.cluster.loop_stall [--compare REF] [--reps 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import redis

from benchmarks.common import DEFAULT_OUT, MODEL_NAME, ROOT, ConveyorUp, percentile, print_table, stamp, write_json
from shared.wire.constants import Names
from shared.process.liveness import entry_at

NAMESPACE = "loopstall"
PROBE_EVERY_S = 0.05
CHAT = [{"role": "user", "content": "Tell me a long story about a river."}]
PAYLOADS = ("logprobs_json", "logprobs_stream", "tools_128", "stop_strings")


def _tools() -> list[dict]:
    """128 tools of ~7 KB of schema each (the body stays under the default 1 MiB limit), each schema its own and
    fresh each call (the gateway compiles a schema once). Rendered into the prompt they are far longer than the
    model's context: the tokenizer answers 400 too_long, after the gateway parsed, checked and compiled them."""
    mark = uuid.uuid4().hex[:8]
    field = {
        "anyOf": [
            {"type": "string", "pattern": "^[a-z]{1,8}[0-9]{2,4}$"},
            {"type": "integer", "minimum": 0, "maximum": 1000},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"a": {"type": "string"}, "b": {"enum": ["x", "y", "z"]}},
                    "required": ["a"],
                },
            },
        ]
    }
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"tool {i} of {mark}",
                "parameters": {
                    "type": "object",
                    "required": [f"p0_{i}_{mark}"],
                    "properties": {f"p{j}_{i}_{mark}": field for j in range(28)},
                },
            },
        }
        for i in range(128)
    ]


def payload(name: str) -> dict:
    base = {"model": MODEL_NAME, "messages": CHAT, "timeout": 600}
    big = {**base, "n": 16, "max_tokens": 4096, "ignore_eos": True}
    if name == "logprobs_json":
        return {**big, "logprobs": True, "top_logprobs": 20}
    if name == "logprobs_stream":
        return {**big, "logprobs": True, "top_logprobs": 20, "stream": True}
    if name == "tools_128":
        return {**base, "tools": _tools(), "max_tokens": 16}
    if name == "stop_strings":
        return {**big, "stop": [c * 256 for c in "#@~^"], "stream": True}
    raise ValueError(name)


def probe(url: str, redis_url: str, stop, conn) -> None:
    """In a process of its own (the client parsing 100 MB must not delay it), two threads until stop is set:
    (start, /health latency) and (read at, liveness entry age) every PROBE_EVERY_S, apart, so that a /health
    held for seconds does not hide the ages meanwhile. Both lists go back through conn."""
    health: list[tuple] = []
    ages: list[tuple] = []
    threads = [
        threading.Thread(target=_probe_health, args=(url, stop, health)),
        threading.Thread(target=_probe_liveness, args=(redis_url, stop, ages)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send((health, ages))


def _every(stop, step) -> None:
    while not stop.is_set():
        t0 = time.time()
        step(t0)
        time.sleep(max(0.0, PROBE_EVERY_S - (time.time() - t0)))


def _probe_health(url: str, stop, out: list) -> None:
    with httpx.Client(timeout=120) as client:

        def step(t0: float) -> None:
            try:
                ok = client.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append((t0, time.time() - t0 if ok else None))

        _every(stop, step)


def _probe_liveness(redis_url: str, stop, out: list) -> None:
    r = redis.Redis.from_url(redis_url, socket_timeout=30)
    key = Names(NAMESPACE).live_hash("gateway")

    def step(t0: float) -> None:
        ats = [entry_at(v) for v in r.hgetall(key).values()]
        out.append((t0, time.time() - max(ats) if ats else None))

    _every(stop, step)


def send(url: str, name: str) -> dict:
    """One payload, read to its end; what it took and what came back."""
    body = payload(name)
    t0 = time.time()
    with httpx.Client(timeout=900) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            size, events = 0, 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                events += chunk.count(b"\n\ndata: ") if body.get("stream") else 0
            status = resp.status_code
    return {"payload": name, "status": status, "bytes": size, "events": events, "t0": t0, "t1": time.time()}


def window_stats(run: dict, health: list[tuple], ages: list[tuple]) -> dict:
    """The probe's samples that overlapped the payload's run."""
    inside = [s for s in health if s[0] <= run["t1"] and s[0] + (s[1] or 0) >= run["t0"]]
    lat = [s[1] for s in inside if s[1] is not None]
    age = [a for t, a in ages if run["t0"] <= t <= run["t1"] and a is not None]
    return {
        "health_max_s": max(lat, default=None),
        "health_p99_s": percentile(lat, 99),
        "health_failed": sum(1 for s in inside if s[1] is None),
        "live_age_max_s": max(age, default=None),
        "payload_s": run["t1"] - run["t0"],
        "samples": len(inside),
        "age_samples": len(age),
    }


def run_cluster(root: Path, label: str, args, out: Path) -> list[dict]:
    env = {
        "CONVEYOR_ENGINE": "sim",
        "CONVEYOR_SIM_SPEEDUP": str(args.speedup),
        "CONVEYOR_NAMESPACE": NAMESPACE,
        "CONVEYOR_LOG_LEVEL": "WARNING",
    }
    rows = []
    with ConveyorUp(out / f"loop_stall-{label}.log", workers=1, env=env, root=root) as up:
        ctx = mp.get_context("spawn")
        stop, (mine, theirs) = ctx.Event(), ctx.Pipe()
        p = ctx.Process(target=probe, args=(up.url, up.find_redis_url(), stop, theirs), daemon=True)
        p.start()
        try:
            time.sleep(1.0)
            for name in args.payloads:
                for rep in range(args.reps):
                    run = send(up.url, name)
                    print(
                        f"[{label}] {name} #{rep}: HTTP {run['status']}, {run['bytes'] / 1e6:.1f} MB, "
                        f"{run['t1'] - run['t0']:.1f} s",
                        flush=True,
                    )
                    rows.append({"tree": label, **run})
                    time.sleep(1.0)  # the probe sees the loop settle between payloads
        finally:
            stop.set()
            health, ages = mine.recv() if mine.poll(60) else ([], [])
            p.join(timeout=10)
    for row in rows:
        row.update(window_stats(row, health, ages))
    return rows


def baseline_tree(ref: str) -> Path:
    """The source of git commit ref, extracted into a temporary folder (nothing of this checkout changes)."""
    dest = Path(tempfile.mkdtemp(prefix=f"loop-stall-{ref[:12]}-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def summary(rows: list[dict]) -> dict:
    """Per tree and payload: the worst of its repetitions."""
    out: dict = {}
    for r in rows:
        key = (r["tree"], r["payload"])
        cur = out.setdefault(key, {"tree": r["tree"], "payload": r["payload"], "ok": 0, "runs": 0})
        cur["runs"] += 1
        cur["ok"] += r["status"] == 200
        for f in ("health_max_s", "health_p99_s", "live_age_max_s", "payload_s", "bytes"):
            if r.get(f) is not None:
                cur[f] = max(cur.get(f, r[f]), r[f])
    return out


def report(rows: list[dict], payloads: list[str], trees: list[str]) -> None:
    agg = summary(rows)
    print_table(
        ["tree", "payload", "200/runs", "MB", "health max s", "health p99 s", "liveness age max s", "payload s"],
        [
            [
                a["tree"],
                a["payload"],
                f"{a['ok']}/{a['runs']}",
                a.get("bytes", 0) / 1e6,
                a.get("health_max_s"),
                a.get("health_p99_s"),
                a.get("live_age_max_s"),
                a.get("payload_s"),
            ]
            for a in agg.values()
        ],
    )
    if len(trees) == 2:
        before, after = trees
        print("\nbefore / after (worst of the repetitions):")
        ratio = []
        for name in payloads:
            b, a = agg.get((before, name), {}), agg.get((after, name), {})
            ratio.append(
                [
                    name,
                    *(
                        _ratio(b.get(f), a.get(f))
                        for f in ("health_max_s", "health_p99_s", "live_age_max_s", "payload_s")
                    ),
                ]
            )
        print_table(["payload", "health max", "health p99", "liveness age max", "payload time"], ratio)


def _ratio(before, after) -> str:
    return "-" if not before or not after else f"{before / after:.1f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--payloads",
        type=lambda s: s.split(","),
        default=list(PAYLOADS),
        help=f"comma-separated, of {', '.join(PAYLOADS)}",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--speedup", type=float, default=200.0, help="CONVEYOR_SIM_SPEEDUP")
    ap.add_argument("--compare", metavar="REF", help="also run the tree of this git commit, first (before)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, trees = [], []
    if args.compare:
        trees.append("before")
        print(f"before: the tree of {args.compare}; after: {ROOT}", flush=True)
        rows += run_cluster(baseline_tree(args.compare), "before", args, args.out)
    trees.append("after")
    rows += run_cluster(ROOT, "after", args, args.out)
    report(rows, args.payloads, trees)
    path = write_json(
        args.out, "loop_stall", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, stamp()
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
