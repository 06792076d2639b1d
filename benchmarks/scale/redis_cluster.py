"""Redis Cluster (issue 16): the control plane on one redis-server against a 3-master Redis Cluster, same load.

One run starts, in turn (--order, by default single, cluster, cluster, single: each twice, in both orders, so a
drift of the shared machine's load shows as a difference between a setup's two runs, not as a difference
between the setups), a fresh `conveyor up --engine sim --workers 4` (benchmarks/scale/control_plane.py's settings):
- single: on the redis-server `conveyor up` starts itself (appendonly yes), as today;
- cluster: on a LocalRedisCluster (tests/support/redis_cluster.py: 3 masters + 1 replica each, on loopback), with
  `--redis-cluster` (16 partitions), every node set to appendonly yes as the single one is (docs/deploy.md).
Each run measures first an idle window (the services' polling alone: commands/s and CPU with no request), then
the levels of benchmarks/scale/control_plane.py (N client loops streaming greedy requests, every stream checked).

Per level, beside control_plane's figures (tokens/s, pipeline-added TTFT/TPOT, CPU per service, memory): from
EVERY Redis node, INFO commandstats and INFO cpu (used_cpu_sys + used_cpu_user) deltas: commands per token in
total (the masters' sum) and per master with its share, Redis CPU seconds per 1,000 tokens per node (replicas
too: replication costs), each node's top commands. Where the cluster's keys sit (which master holds which
partitions, worker inboxes and gateway reply streams) is recorded with each cluster run.

Run: flock /tmp/conveyor-bench.lock nice -n 5 .venv/bin/python -m benchmarks.scale.redis_cluster --levels 100 1000
Tables for docs/benchmarks.md from a result: .venv/bin/python -m benchmarks.scale.redis_cluster --markdown RESULT.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.scale import control_plane as cp
from benchmarks.scale import control_plane_measure as m
from benchmarks.scale.redis_cluster_report import print_summary, summarize
from benchmarks.common import ROOT, ConveyorUp, log_summary, raise_fd_limit, stamp, write_json
from shared.wire.constants import CLUSTER_PARTITIONS, Names
from shared.settings import CommonSettings
from tests.support.redis_cluster import LocalRedisCluster


# --- the Redis of each setup -----------------------------------------------------------------------------------


def start_redis_cluster(folder: Path, args) -> LocalRedisCluster:
    rc = LocalRedisCluster(folder, masters=args.masters, node_timeout_ms=args.node_timeout_ms).start()
    try:
        if args.appendonly:  # as the single Redis `conveyor up` starts (and as docs/deploy.md asks of a cluster)
            for node in rc.nodes:
                node.client.config_set("appendonly", "yes")
            deadline = time.monotonic() + 60
            while any(n.info("persistence").get("aof_rewrite_in_progress") for n in rc.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster's nodes did not finish their first AOF rewrite in 60 s")
                time.sleep(0.1)
    except BaseException:
        rc.stop()
        raise
    return rc


def cluster_target(rc: LocalRedisCluster, names: Names) -> m.RedisTarget:
    """The nodes labelled m0.. (masters, by the slot range they serve) and rI (the replica of mI)."""
    masters = sorted(
        (n for n in rc.nodes if n.is_master()),
        key=lambda n: min(p for p in names.all_partitions if rc.master_for_key(names.received_stream(p)) is n),
    )
    nodes = {f"m{i}": n.url for i, n in enumerate(masters)}
    for i, master in enumerate(masters):
        for j, replica in enumerate(rc.replicas_of(master)):
            nodes[f"r{i}" + (f".{j}" if j else "")] = replica.url
    return m.RedisTarget(nodes, names, cluster=True)


def cluster_layout(rc: LocalRedisCluster, target: m.RedisTarget) -> dict:
    """Which master holds which partitions, worker inboxes, gateway reply streams and one-slot shared keys."""
    names = target.names
    label_of = {url: label for label, url in target.nodes.items()}
    at = lambda key: label_of[rc.master_for_key(key).url]  # noqa: E731
    client = redis.RedisCluster.from_url(rc.url, socket_timeout=10)
    try:
        instances = {s: sorted(x.decode() for x in client.hkeys(names.live_hash(s))) for s in ("worker", "gateway")}
    finally:
        client.close()
    out = {
        label: {"partitions": [], "worker_inboxes": 0, "gateway_reply_streams": 0, "shared": []}
        for label in target.masters
    }
    for p in names.all_partitions:
        out[at(names.received_stream(p))]["partitions"].append(p)
    for w in instances["worker"]:
        out[at(names.worker_stream(w))]["worker_inboxes"] += 1
    for g in instances["gateway"]:
        out[at(names.reply_stream(g))]["gateway_reply_streams"] += 1
    for what, key in [
        ("control", names.control_stream),
        ("heartbeat", names.heartbeat_stream),
        ("kv_events", names.kv_events_stream),
        ("live_worker", names.live_hash("worker")),
        ("live_gateway", names.live_hash("gateway")),
        ("live_scheduler", names.live_hash("scheduler")),
        ("epoch", names.epoch),
    ]:
        out[at(key)]["shared"].append(what)
    return out


def node_log_lines(folder: Path) -> dict:
    """Lines of the cluster nodes' logs that say a node was judged failing or failed over (none expected)."""
    pat = re.compile(r"FAIL|[Ff]ailover|Marking node|Cluster state changed: fail|[Ee]lection")
    out = {}
    for log in sorted(folder.glob("redis-*.log")):
        hits = [line.strip()[-200:] for line in log.read_text(errors="replace").splitlines() if pat.search(line)]
        if hits:
            out[log.name] = {"lines": len(hits), "first": hits[:5]}
    return out


# --- one run ---------------------------------------------------------------------------------------------------


def idle_window(cluster: ConveyorUp, target: m.RedisTarget, seconds: float) -> dict:
    """Commands/s and CPU with no request in flight: the fixed cost of the services' polling and heartbeats."""
    before = m.snapshot(cluster, target)
    time.sleep(seconds)
    after = m.snapshot(cluster, target)
    secs = after["t"] - before["t"]
    nodes = m.node_figures(before, after, 1)
    cmds = m.delta(after["commands"], before["commands"])
    return {
        "seconds": secs,
        "redis_commands_per_s": sum(cmds.values()) / secs,
        "redis_top_commands_per_s": [(k, v / secs) for k, v in sorted(cmds.items(), key=lambda kv: -kv[1])[:10]],
        "redis_cpu_core_share": {k: n["cpu_core_share"] for k, n in nodes.items()},
        "redis_commands_per_s_by_node": {k: n["commands_per_s"] for k, n in nodes.items()},
        "cpu_core_share": {k: v / secs for k, v in m.delta(after["cpu"], before["cpu"]).items()},
    }


def redis_target(cluster: ConveyorUp, rc: LocalRedisCluster | None, env: dict) -> m.RedisTarget:
    """The Redis a run measures: every node of the cluster, or the single one `conveyor up` started."""
    if rc is None:
        return m.RedisTarget.single(cluster.find_redis_url())
    partitions = int(env.get("CONVEYOR_REDIS_PARTITIONS", 0)) or CLUSTER_PARTITIONS
    return cluster_target(rc, Names(CommonSettings().namespace, partitions, cluster=True))


def print_idle(idle: dict) -> None:
    print(
        f"idle: {idle['redis_commands_per_s']:.0f} Redis commands/s "
        f"(top {[(k, round(v)) for k, v in idle['redis_top_commands_per_s'][:4]]})",
        flush=True,
    )


def one_run(kind: str, i: int, args, env: dict, texts: list[str], expected: list[str], run_id: str) -> dict:
    tag = f"{run_id}-{i}-{kind}"
    run_args = copy.copy(args)
    run_args.steps_dir = args.out / f"redis_cluster-{tag}-steps"
    env = {**env, "CONVEYOR_SIM_STEP_LOG_DIR": str(run_args.steps_dir)}
    log = args.out / f"redis_cluster-{tag}-conveyor.log"
    rc, folder, layout, roles_before = None, None, None, None
    print(f"\n##### run {i}: {kind} #####", flush=True)
    try:
        up_args = ["--engine", "sim"]
        if kind == "cluster":
            folder = Path(tempfile.mkdtemp(prefix="conveyor-bench-cluster-"))
            rc = start_redis_cluster(folder, args)
            print(f"Redis Cluster up in {rc.created_in_s:.1f} s: {rc.node_urls}", flush=True)
            up_args.append("--redis-cluster")
        with ConveyorUp(log, workers=args.workers, redis_url=rc.url if rc else None, env=env, args=up_args) as cluster:
            target = redis_target(cluster, rc, env)
            roles_before = dict(target.roles) if rc else None
            time.sleep(args.warm)  # every service past its start-up writes
            if rc:
                layout = cluster_layout(rc, target)
            idle = idle_window(cluster, target, args.idle_window)
            print_idle(idle)
            results = cp.run_levels(cluster, run_args, texts, expected, args.out, tag, target)
            roles_after = target.current_roles()
    finally:
        if rc:
            rc.stop()
    out = {
        "kind": kind,
        "run": i,
        "nodes": target.nodes,
        "roles": roles_after,
        "idle_window": idle,
        "levels": results[:-1],
        "idle_after": results[-1],
        "server_log": log_summary(log),
        "log": str(log),
    }
    if rc:
        out.update(
            layout=layout,
            roles_before=roles_before,
            failover=roles_before != roles_after,
            node_log=node_log_lines(folder),
        )
        shutil.rmtree(folder, ignore_errors=True)
    return out


# --- main ------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--duration", type=float, default=15, help="seconds each client loop keeps sending")
    ap.add_argument(
        "--order", nargs="+", choices=["single", "cluster"], default=["single", "cluster", "cluster", "single"]
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--api", choices=["completions", "chat", "generate"], default="completions")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument(
        "--node-timeout-ms",
        type=int,
        default=5000,
        help="cluster-node-timeout: docs/deploy.md's upper "
        "value, so a node starved of CPU by the load is not judged failed",
    )
    ap.add_argument(
        "--no-appendonly",
        dest="appendonly",
        action="store_false",
        help="leave the cluster's nodes without AOF (the single Redis of `conveyor up` has it)",
    )
    ap.add_argument("--prompts", type=int, default=512, help="distinct prompts")
    ap.add_argument("--probe-s", type=float, default=0.2, help="seconds between /health probes")
    ap.add_argument("--warm", type=float, default=3, help="seconds after ready before the idle window")
    ap.add_argument("--idle-window", type=float, default=10, help="seconds idle measured before the levels")
    ap.add_argument("--settle", type=float, default=3, help="seconds after a level before its CPU snapshot")
    ap.add_argument("--idle", type=float, default=2, help="seconds idle after the last level")
    ap.add_argument("--capacity-cores", type=float, default=0.8, help="share of one core a shard may use")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="extra CONVEYOR_* settings")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="results folder")
    ap.add_argument("--markdown", type=Path, metavar="RESULT.json", help="print the tables of a result and exit")
    return ap.parse_args()


def print_tables(result: Path) -> None:
    """The tables of a result, its summary recomputed from the runs: a result of an older version gets today's."""
    data = json.loads(result.read_text())
    data["summary"] = summarize(data["runs"], data["args"]["levels"], data["args"].get("capacity_cores", 0.8))
    print_summary(data)


def main() -> None:
    args = parse_args()
    if args.markdown:
        print_tables(args.markdown)
        return
    fds, run_id = raise_fd_limit(), stamp()
    args.out.mkdir(parents=True, exist_ok=True)
    # the services are subprocesses (cwd ROOT): this tree's code, whatever else is installed
    env = {
        **cp.CLUSTER_ENV,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
        **dict(s.split("=", 1) for s in args.set),
    }
    texts = cp.prompts(args.prompts)
    expected = cp.expected_texts(args.api, texts, args.max_tokens)
    print(
        f"redis cluster: order {args.order}, levels {args.levels}, {args.duration:.0f} s each, {args.api}, "
        f"{args.max_tokens} tokens, {args.workers} sim workers, open files limit {fds}, load average "
        f"{os.getloadavg()}",
        flush=True,
    )
    runs = [one_run(kind, i, args, env, texts, expected, run_id) for i, kind in enumerate(args.order)]
    data = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": env,
        "started": run_id,
        "load_average_end": os.getloadavg(),
        "runs": runs,
        "summary": summarize(runs, args.levels, args.capacity_cores),
    }
    path = write_json(args.out, "redis_cluster", data, run_id)
    print_summary(json.loads(path.read_text()))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
