"""Multi-turn conversations (issue 26): TTFT by turn index, Conveyor against vLLM (prefix caching on).

Same machine, same model (the bundled SmolLM2-135M-Instruct, float32), same KV budget, same client: NVIDIA AIPerf
(`aiperf profile`, PyPI `aiperf`), installed into a venv of its own (default ~/.cache/conveyor-peers/aiperf,
$AIPERF_VENV), never a runtime dependency: `.venv/bin/python -m benchmarks.peer.multiturn --install`.

The workload is AIPerf's synthetic multi-turn chat: --conversations conversations of --turns turns, each user turn
--isl tokens of text, --osl output tokens (`max_completion_tokens`, `ignore_eos`, temperature 0, streamed),
--think-ms (normal, --think-stddev-ms) between a reply and the conversation's next turn, --concurrency
conversations at once (AIPerf holds one slot per conversation for its whole life). Each turn resends the whole
conversation (earlier user turns and the replies the server gave), so turn k's prompt is turn k-1's prompt plus
a reply and a user turn: what a server keeps of a conversation between its turns is what it need not prefill.
Every request of a conversation carries its id, a UUID, in `X-Correlation-ID`, `X-Session-ID` (AIPerf's
AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID=true) and `X-Session-Affinity`; `--session-headers correlation`
leaves out X-Session-ID (an A/B against the same server without the header Conveyor's sessions key on).

The servers run one after the other, never both at once, each started fresh, warmed up by a few requests outside
the measurement, measured, stopped:
  vllm      benchmarks/peer/vllm_cpu.py (vLLM 0.32 CPU, float32, both cores) with --enable-prefix-caching
            --enable-prompt-tokens-details (per-request cached tokens) and VLLM_CPU_KVCACHE_SPACE=--kv-gib
  conveyor  `conveyor up --workers 1` with CONVEYOR_KV_CACHE_BYTES=--kv-gib GiB; --conveyor-env KEY=VALUE
            (repeatable) and --conveyor-args pass the session settings the server side adds; --conveyor-root
            runs another checkout's code.
Both pools are the same bytes; in tokens each server's log says (recorded as kv_capacity_tokens). At the
defaults (16 x 10 turns of 200 + 64 tokens) the last turns hold ~16 x 2,700 tokens: more than 1 GiB holds.

Prints and writes (JSON in --out, default docs/results/; the plot beside it; AIPerf's artifacts and the
servers' logs under benchmarks/results/multiturn-ID/): per turn index, TTFT p50/p99/mean of each server and
Conveyor/vLLM, prompt and cached tokens (usage.prompt_tokens_details.cached_tokens) and so the prefill tokens
computed; per server, output tok/s over the run (first send to last answer), requests failed, the servers'
/metrics counters (prompt tokens, prefix cache hits, preemptions, any session counter) before/after, and the CPU
seconds of the client and of the server. The goal (issue 26): TTFT flat across turns and, from turn 5 on, at most
half of vLLM's; output throughput at least vLLM's.

Run (one load benchmark at a time on this machine: wrap it in `flock /tmp/conveyor-bench.lock`):
  .venv/bin/python -m benchmarks.peer.multiturn --install            # once: AIPerf into its venv (~1 min, 1.2 GB)
  .venv/bin/python -m benchmarks.peer.multiturn                      # vLLM, then Conveyor: 16 x 10 turns
  .venv/bin/python -m benchmarks.peer.multiturn --smoke              # 2 conversations x 3 turns, tiny
  .venv/bin/python -m benchmarks.peer.multiturn --servers conveyor --conveyor-env CONVEYOR_SOME_SESSION_SETTING=...
  .venv/bin/python -m benchmarks.peer.multiturn --servers conveyor --vllm-from docs/results/multiturn-ID.json
      (Conveyor only, against an earlier run's vLLM figures for the same workload: ~11 min instead of ~20)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from benchmarks.common import (
    tree_cpu_s,
    DEFAULT_OUT,
    MODEL_NAME,
    ROOT,
    ConveyorUp,
    log_summary,
    model_dir,
    raise_fd_limit,
    stamp,
    write_json,
)
from benchmarks.peer.multiturn_aiperf import AIPERF_VENV, AIPERF_VERSION, aiperf_cmd, aiperf_installed, install_aiperf
from benchmarks.peer.multiturn_report import load_records, plot, report, summarize
from benchmarks.peer.vllm_peer import (
    INSTALL,
    VllmServe,
    vllm_installed,
)

RESULTS = ROOT / "docs" / "results"
GIB = 1 << 30
# /metrics counters worth a before/after: vLLM's (vllm:...) and Conveyor's (conveyor:...), whatever their suffix.
COUNTERS = re.compile(r"^(vllm|conveyor):\w*(prompt_tokens|generation_tokens|prefix_cache|preempt|session)\w*$")
SMOKE = {"conversations": 2, "turns": 3, "isl": 48, "osl": 16, "think_ms": 500.0, "think_stddev_ms": 0.0}


# ---- servers ----


def scrape_counters(url: str) -> dict[str, float]:
    """The COUNTERS of GET url/metrics, summed over their labels; {} when it does not answer."""
    try:
        return parse_counters(httpx.get(f"{url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return {}


def parse_counters(text: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and COUNTERS.match(m.group(1)) and not m.group(1).endswith(("_created", "_bucket")):
            out[m.group(1)] += float(m.group(3))  # Prometheus' values, NaN and +Inf included, all parse
    return dict(out)


def kv_capacity_tokens(log: Path) -> int | None:
    """The KV pool in tokens, as the server logged it at start."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if m := re.search(r"engine ready: (\d+) KV blocks x (\d+) tokens", text):  # Conveyor's worker
        return int(m.group(1)) * int(m.group(2))
    if m := re.search(r"KV cache size: ([\d,]+) tokens", text):  # vLLM's engine core
        return int(m.group(1).replace(",", ""))
    return None


def warm_up(url: str, n: int = 4) -> float:
    """A few chat requests outside the measurement, long and short, n at once: one-off costs (kernel selection
    per shape, the first allocations) out of turn 1's TTFT. Seconds taken."""
    import asyncio

    words = "the quick brown fox jumps over the lazy dog while a small model keeps the conversation going".split()

    async def one(client: httpx.AsyncClient, i: int, length: int) -> None:
        text = " ".join(words[(i + k) % len(words)] for k in range(length))
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": f"warm-up {i}: {text}"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await one(client, 0, 40)
            await asyncio.gather(*[one(client, i, 1500 if i % 2 else 300) for i in range(1, n + 1)])

    t0 = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - t0


class Server:
    """One server under test: started, warmed up, measured by AIPerf, stopped."""

    def __init__(self, name: str, args, model: Path, out: Path):
        self.name, self.args, self.model, self.out = name, args, model, out
        self.log = out / f"{name}.log"
        self.env: dict[str, str] = {}
        if name == "vllm":
            # vllm_cpu.serve_command reads VLLM_CPU_KVCACHE_SPACE (whole GiB, vLLM's CPU pool) from the environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
            extra = ["--enable-prefix-caching", "--enable-prompt-tokens-details", *args.vllm_args]
            self.impl = VllmServe(model, self.log, extra=extra)
            self.settings = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "vllm_args": extra}
        else:
            self.env = {"CONVEYOR_KV_CACHE_BYTES": str(args.kv_gib * GIB), **args.conveyor_env}
            self.impl = ConveyorUp(self.log, workers=1, env=self.env, args=args.conveyor_args, root=args.conveyor_root)
            self.settings = {"env": self.env, "args": args.conveyor_args, "root": str(args.conveyor_root)}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.impl.port}"

    def start(self) -> float:
        t0 = time.monotonic()
        self.impl.start()
        return time.monotonic() - t0

    def stop(self) -> None:
        self.impl.stop()

    def process(self) -> psutil.Process:
        return psutil.Process(self.impl.proc.pid)


# ---- the client ----


def run_aiperf(server: Server, args, model: Path) -> dict:
    artifacts = server.out / f"aiperf-{server.name}"
    cmd = aiperf_cmd(server.url, model, args, artifacts)
    env = {**os.environ, "AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID": str(args.session_headers == "both").lower()}
    env.pop("HF_HUB_OFFLINE", None)  # AIPerf 0.13's offline path cannot load a tokenizer from a local folder
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    before_ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = server.process()
    before_cpu, before_counters = tree_cpu_s(proc), scrape_counters(server.url)
    load_before = os.getloadavg()[0]  # a shared machine: what else ran is part of the result
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.client_timeout)
    wall = time.monotonic() - t0
    after_ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    after_cpu, after_counters = tree_cpu_s(proc), scrape_counters(server.url)
    (server.out / f"aiperf-{server.name}.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    res = {
        "returncode": p.returncode,
        "client_wall_s": round(wall, 1),
        # every process AIPerf started (it waits for its services), and the server's tree meanwhile
        "client_cpu_s": round(after_ru.ru_utime + after_ru.ru_stime - before_ru.ru_utime - before_ru.ru_stime, 1),
        "server_cpu_s": round(after_cpu - before_cpu, 1),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "counters": {k: after_counters[k] - before_counters.get(k, 0.0) for k in sorted(after_counters)},
        "artifacts": str(artifacts),
    }
    records = artifacts / "profile_export.jsonl"
    if p.returncode != 0 or not records.exists():
        print(f"aiperf exited with {p.returncode}; its output's tail:\n{(p.stdout + p.stderr)[-2500:]}", flush=True)
        return res
    res.update(summarize(load_records(records)))
    summary = artifacts / "profile_export_aiperf.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        res["aiperf_summary"] = {
            k: s[k].get("avg")
            for k in ("output_token_throughput", "request_throughput", "benchmark_duration", "request_count")
            if isinstance(s.get(k), dict)
        }
    return res


def kv(text: str) -> tuple[str, str]:
    k, _, v = text.partition("=")
    if not k or not _:
        raise argparse.ArgumentTypeError(f"KEY=VALUE, not {text!r}")
    return k, v


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help=f"install AIPerf {AIPERF_VERSION} into {AIPERF_VENV}, exit")
    ap.add_argument("--servers", default="vllm,conveyor", help="which, in order (default vllm,conveyor)")
    ap.add_argument("--smoke", action="store_true", help="2 conversations x 3 turns of 48 + 16 tokens")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--isl", type=int, default=200, help="tokens of each user turn")
    ap.add_argument("--osl", type=int, default=64, help="output tokens of each turn (ignore_eos)")
    ap.add_argument("--think-ms", type=float, default=750.0, help="mean think time between turns")
    ap.add_argument("--think-stddev-ms", type=float, default=250.0)
    ap.add_argument("--concurrency", type=int, default=0, help="conversations at once; default all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gib", type=int, default=1, help="KV pool of both servers, whole GiB (vLLM's unit)")
    ap.add_argument(
        "--session-headers",
        choices=["both", "correlation"],
        default="both",
        help="both: X-Correlation-ID and X-Session-ID per conversation; correlation: X-Correlation-ID only",
    )
    ap.add_argument("--conveyor-env", type=kv, action="append", default=[], help="KEY=VALUE for the Conveyor cluster")
    ap.add_argument("--conveyor-args", type=shlex.split, default=[], help="extra `conveyor up` arguments, one string")
    ap.add_argument("--conveyor-root", type=Path, default=ROOT, help="the checkout whose Conveyor runs")
    ap.add_argument("--vllm-args", type=shlex.split, default=[], help="extra `vllm serve` arguments, one string")
    ap.add_argument(
        "--vllm-from",
        type=Path,
        default=None,
        help="compare against the vLLM results of an earlier run's JSON (same workload) instead of running vLLM",
    )
    ap.add_argument("--aiperf-args", type=shlex.split, default=[], help="extra `aiperf profile` arguments")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="AIPerf's per-request timeout, s")
    ap.add_argument("--client-timeout", type=float, default=1800.0, help="one AIPerf run at most, s")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON and PNG (default docs/results)")
    ap.add_argument("--artifacts", type=Path, default=DEFAULT_OUT, help="AIPerf's files and the servers' logs")
    return ap.parse_args()


def servers_to_run(args) -> list[str]:
    """The servers --servers names, in order, once --smoke's workload is set and what they need is installed."""
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    args.conveyor_env = dict(args.conveyor_env)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := set(servers) - {"vllm", "conveyor"}:
        raise SystemExit(f"unknown servers: {sorted(unknown)}")
    if not aiperf_installed():
        raise SystemExit(f"AIPerf is not installed: {sys.executable} -m benchmarks.peer.multiturn --install")
    if "vllm" in servers and not args.vllm_from and not vllm_installed():
        raise SystemExit(f"vLLM is not installed: {INSTALL} (or --servers conveyor)")
    return servers


def workload_of(args) -> dict:
    workload = {
        k: getattr(args, k)
        for k in ("conversations", "turns", "isl", "osl", "think_ms", "think_stddev_ms", "seed", "session_headers")
    }
    workload["concurrency"] = args.concurrency or args.conversations
    workload["kv_bytes"] = args.kv_gib * GIB
    return workload


def earlier_vllm(path: Path, workload: dict) -> dict:
    """vLLM's results in an earlier run's JSON (--vllm-from), which must have run the same workload."""
    earlier = json.loads(path.read_text())
    if earlier["workload"] != workload:
        raise SystemExit(f"{path} ran another workload: {earlier['workload']}")
    return {**earlier["results"]["vllm"], "from": str(path)}


def measure(sname: str, args, model: Path, out: Path) -> dict:
    """One server started fresh, warmed up, measured by AIPerf and stopped: its results (an error among them)."""
    server = Server(sname, args, model, out)
    res: dict = {"settings": server.settings}
    try:
        res["start_s"] = round(server.start(), 1)
        res["kv_capacity_tokens"] = kv_capacity_tokens(server.log)
        res["warmup_s"] = round(warm_up(server.url), 1)
        res.update(run_aiperf(server, args, model))
    except Exception as e:  # the other server still runs; the error is in the results
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"{sname}: {res['error']}", flush=True)
    finally:
        server.stop()
    res["kv_capacity_tokens"] = res.get("kv_capacity_tokens") or kv_capacity_tokens(server.log)
    res["log"] = log_summary(server.log)
    brief = {k: res.get(k) for k in ("requests", "failed", "duration_s", "output_tok_s", "client_wall_s")}
    print(f"{sname}: {brief}", flush=True)
    return res


def write_results(
    args, name: str, run_id: str, out: Path, model: Path, workload: dict, results: dict, wall: float
) -> None:
    """The report and the verdict printed, the plot and the JSON written (out: the run's artifacts)."""
    verdict = report(results)
    title = (
        f"{workload['conversations']} conversations x {workload['turns']} turns, {workload['isl']}-token user turns, "
        f"{workload['osl']} out, think {workload['think_ms']:.0f} ms, concurrency {workload['concurrency']}, "
        f"KV {args.kv_gib} GiB, SmolLM2-135M f32, 2 cores ({run_id})"
    )
    png = plot(results, args.out / f"{name}-{run_id}.png", title)
    data = {
        "workload": workload,
        "client": f"aiperf {AIPERF_VERSION}",
        "model": str(model),
        "results": results,
        "verdict": verdict,
        "wall_s": round(wall, 1),
        "plot": str(png) if png else None,
        "artifacts": str(out),
    }
    path = write_json(args.out, name, data, run_id)
    print(f"\nwall {wall:.0f} s; results: {path}" + (f", plot: {png}" if png else "") + f" (artifacts in {out})")


def main() -> None:
    args = parse_args()
    if args.install:
        install_aiperf()
        return
    servers = servers_to_run(args)
    raise_fd_limit()
    run_id = stamp()
    name = "multiturn-smoke" if args.smoke else "multiturn"
    out = args.artifacts / f"{name}-{run_id}"
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    workload = workload_of(args)
    print(f"workload: {workload}; artifacts in {out}", flush=True)
    t_all = time.monotonic()
    results: dict[str, dict] = {}
    if args.vllm_from:
        results["vllm"] = earlier_vllm(args.vllm_from, workload)
        servers = [s for s in servers if s != "vllm"]
    for sname in servers:
        results[sname] = measure(sname, args, model, out)
    write_results(args, name, run_id, out, model, workload, results, time.monotonic() - t_all)


if __name__ == "__main__":
    main()
