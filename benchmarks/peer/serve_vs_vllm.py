"""Serving throughput, Conveyor against vLLM's CPU build: same machine, same model, same client, one run.

Both servers are started once and stay up (each idles while the other is measured): `conveyor up --workers 1`
(defaults) and vLLM 0.32 CPU via benchmarks/peer/vllm_cpu.py (float32, both cores, tcmalloc + iomp). The
client is vLLM's own, `vllm bench serve` (random dataset, --ignore-eos, request rate inf). For every shape
(input/output tokens) and concurrency, rounds alternate which server goes first; every round is reported
with the ratio Conveyor/vLLM of output tok/s, and mean TTFT and TPOT of both.

Run: .venv/bin/python -m benchmarks.peer.serve_vs_vllm [--rounds 2] [--shapes 128x128,512x128,32x256]
     [--concurrency 1,8,32,64] [--out DIR]
  bfloat16 on both: --conveyor-env CONVEYOR_DTYPE=bfloat16 --vllm-args='--dtype bfloat16'
  both held to AVX2 on an AVX-512 CPU (a proxy for an AVX2-only one): --isa avx2
Also prints each server's seconds from launch to /ready, and for every round the CPU seconds of the server
measured (each Conveyor process, vLLM's in all), of the other server idling beside it, and of the client. Before
the first round both get the same short client warm-up (16 requests of 64/16) unless --no-warmup: then the first
round is each server's first traffic after its /ready.
The issue's headline figure is the 128x128 shape at concurrency 32 with 64 prompts.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import time
from pathlib import Path


from benchmarks.peer import isa_hold
from benchmarks.common import (
    cpu_s,
    each_alive,
    DEFAULT_OUT,
    ConveyorUp,
    model_dir,
    print_table,
    raise_fd_limit,
    stamp,
    write_json,
)
from benchmarks.peer.vllm_peer import (
    bench_cmd,
    INSTALL,
    VllmServe,
    vllm_installed,
)

ROLES = ("worker#0", "gateway", "tokenizer", "scheduler", "redis", "launcher")
KEYS = ("completed", "failed", "duration", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms")


def num_prompts(concurrency: int, requested: int | None) -> int:
    """64 at concurrency 32 (the issue's setting); enough for steady state elsewhere without taking minutes."""
    return requested or max(8, 2 * concurrency)


def bench(
    port: int, model: Path, shape: tuple[int, int], concurrency: int, prompts: int, seed: int, out: Path, name: str
) -> dict:
    result_file = f"{name}.json"
    cmd = bench_cmd(port, model, shape[0], shape[1], prompts, concurrency, seed, out / result_file)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    (out / f"{name}.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    path = out / result_file
    if p.returncode != 0 or not path.exists():
        print(f"vllm bench serve failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}", flush=True)
        return {"error": p.returncode}
    data = json.loads(path.read_text())
    res = {k: data.get(k) for k in KEYS}
    res["failed"] = res["failed"] if res["failed"] is not None else prompts - (res["completed"] or 0)
    return res


def cpu_seconds(procs: dict) -> dict[str, float]:
    return each_alive(procs, cpu_s)


def client_cpu_seconds() -> float:
    """CPU seconds of this process's finished children: the client of each round (`vllm bench serve`)."""
    t = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t.ru_utime + t.ru_stime


def measured(name: str, servers: dict, fn) -> dict:
    """fn()'s result with the CPU seconds the machine's two cores gave meanwhile (two cores = 2 s a wall second):
    each process of the server measured (Conveyor's by role, vLLM's in all), the other server idling beside it
    (what it takes from the round: both stay up), and the client. Why: on two cores a round's speed depends on
    what else runs; these say whether a slow round was its server's work or the machine's."""
    procs = {server: s.processes() for server, s in servers.items()}
    before = {server: cpu_seconds(p) for server, p in procs.items()}
    client = client_cpu_seconds()
    res = fn()
    res["client_cpu_s"] = round(client_cpu_seconds() - client, 2)
    for server, p in procs.items():
        after = cpu_seconds(p)
        spent = {role: after[role] - before[server][role] for role in after if role in before[server]}
        if server == name and server == "conveyor":
            res["cpu_s"] = {role: round(v, 2) for role, v in spent.items()}
        else:
            res["cpu_s" if server == name else "idle_peer_cpu_s"] = round(sum(spent.values()), 2)
    return res


def run(servers: dict, model: Path, args, out: Path) -> list[dict]:
    rows = []
    pairs = args.pairs or [(shape, conc) for shape in args.shapes for conc in args.concurrency]
    for shape, conc in pairs:
        prompts = num_prompts(conc, args.num_prompts)
        for rnd in range(1, args.rounds + 1):
            order = list(servers) if rnd % 2 else list(reversed(servers))
            row = {
                "shape": f"{shape[0]}x{shape[1]}",
                "concurrency": conc,
                "prompts": prompts,
                "round": rnd,
                "order": order,
            }
            for name in order:
                tag = f"{name}-{shape[0]}x{shape[1]}-c{conc}-r{rnd}"
                row[name] = measured(
                    name, servers, lambda: bench(servers[name].port, model, shape, conc, prompts, rnd, out, tag)
                )
                print(f"{tag}: {row[name]}", flush=True)
            rows.append(row)
    return rows


def ratio(row: dict, key: str) -> float | None:
    c, v = row.get("conveyor", {}).get(key), row.get("vllm", {}).get(key)
    return c / v if c and v else None


def report(rows: list[dict]) -> None:
    throughput_table(rows)
    cpu_tables(rows)


def throughput_table(rows: list[dict]) -> None:
    """Each round's output tok/s of both servers and their ratio, mean TTFT and TPOT, requests failed."""
    table = []
    for r in rows:
        c, v = r.get("conveyor", {}), r.get("vllm", {})
        table.append(
            [
                r["shape"],
                r["concurrency"],
                r["round"],
                c.get("output_throughput"),
                v.get("output_throughput"),
                ratio(r, "output_throughput"),
                c.get("mean_ttft_ms"),
                v.get("mean_ttft_ms"),
                c.get("mean_tpot_ms"),
                v.get("mean_tpot_ms"),
                f"{c.get('failed')}/{v.get('failed')}",
            ]
        )
    print_table(
        [
            "in x out",
            "conc",
            "round",
            "conveyor tok/s",
            "vllm tok/s",
            "ratio",
            "conveyor TTFT ms",
            "vllm TTFT ms",
            "conveyor TPOT ms",
            "vllm TPOT ms",
            "failed c/v",
        ],
        table,
    )


def cpu_tables(rows: list[dict]) -> None:
    """The CPU seconds of each round: Conveyor's per process, the client's and the idle server's, vLLM's in all."""
    cpu = [
        [r["shape"], r["concurrency"], r["round"], *[r["conveyor"].get("cpu_s", {}).get(role) for role in ROLES]]
        for r in rows
        if "conveyor" in r
    ]
    print("\nConveyor CPU seconds per process during its bench (two cores = 2 s per wall second)")
    print_table(["in x out", "conc", "round", *ROLES], cpu)
    beside = [
        [r["shape"], r["concurrency"], r["round"], name, r[name].get("client_cpu_s"), r[name].get("idle_peer_cpu_s")]
        for r in rows
        for name in r["order"]
    ]
    print("\nBeside each bench: the client's CPU seconds and the idle server's")
    print_table(["in x out", "conc", "round", "measured", "client", "idle server"], beside)
    vllm_cpu = [[r["shape"], r["concurrency"], r["round"], r["vllm"].get("cpu_s")] for r in rows if "vllm" in r]
    if vllm_cpu:
        print("\nvLLM's CPU seconds during its bench (all its processes)")
        print_table(["in x out", "conc", "round", "vllm"], vllm_cpu)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]


def parse_pairs(text: str) -> list[tuple[tuple[int, int], int]]:
    """'128x128@1,512x128@32' -> [((128, 128), 1), ((512, 128), 32)]"""
    return [(parse_shapes(shape)[0], int(conc)) for shape, conc in (p.split("@") for p in text.split(","))]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("128x128"))
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[32])
    ap.add_argument(
        "--pairs",
        type=parse_pairs,
        default=None,
        help="shape@concurrency list instead of the grid, e.g. 128x128@1,512x128@32",
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--conveyor-env", action="append", default=[], help="KEY=VALUE for the Conveyor cluster")
    ap.add_argument("--conveyor-args", type=shlex.split, default=[], help="extra `conveyor up` arguments, one string")
    ap.add_argument(
        "--vllm-args",
        type=shlex.split,
        default=[],
        help="extra `vllm serve` arguments, one string: --vllm-args='--dtype bfloat16'",
    )
    ap.add_argument(
        "--isa",
        choices=("auto", "avx2"),
        default="auto",
        help="avx2: both servers held to AVX2 on an AVX-512 CPU (benchmarks.peer.isa_hold), a proxy for an AVX2-only one",
    )
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="no client warm-up (16 short requests) before the first round: that round is each server's first "
        "traffic after its /ready",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return ap.parse_args()


def timed_start(server):
    """The server started, and the seconds from its launch to its /ready."""
    t = time.monotonic()
    server.start()
    return server, time.monotonic() - t


def main() -> None:
    args = parse_args()
    if not args.skip_vllm and not vllm_installed():
        raise SystemExit(f"vLLM is not installed: {INSTALL} (or pass --skip-vllm)")
    raise_fd_limit()
    run_id = stamp()
    out = args.out / f"serve_vs_vllm-{run_id}"
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    env = {**isa_hold.conveyor_env(args.isa), **dict(kv.split("=", 1) for kv in args.conveyor_env)}
    conveyor, ready_s = timed_start(ConveyorUp(out / "conveyor.log", workers=1, env=env, args=args.conveyor_args))
    ready = {"conveyor": ready_s}
    vllm = None
    if not args.skip_vllm:
        vllm, ready["vllm"] = timed_start(
            VllmServe(model, out / "vllm.log", args.vllm_args, isa_hold.vllm_env(args.isa))
        )
    print("ready after " + ", ".join(f"{name} {s:.1f} s" for name, s in ready.items()), flush=True)
    try:
        servers = {"conveyor": conveyor, **({"vllm": vllm} if vllm else {})}
        for name, server in servers.items() if not args.no_warmup else ():  # one-off costs out of the rounds
            bench(server.port, model, (64, 16), 8, 16, 0, out, f"{name}-warmup")
        t0 = time.monotonic()
        rows = run(servers, model, args, out)
    finally:
        conveyor.stop()
        if vllm:
            vllm.stop()
    report(rows)
    path = write_json(
        args.out,
        "serve_vs_vllm",
        {
            "rows": rows,
            "conveyor_env": env,
            "isa": args.isa,
            "ready_s": ready,
            "client_warmup": not args.no_warmup,
            "wall_s": time.monotonic() - t0,
        },
        run_id,
    )
    print(f"results: {path} (client logs in {out})")


if __name__ == "__main__":
    main()
