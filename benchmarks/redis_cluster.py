"""Redis Cluster (issue 16): the control plane on one redis-server against a 3-master Redis Cluster, same load.

One run starts, in turn (--order, by default single, cluster, cluster, single: each twice, in both orders, so a
drift of the shared machine's load shows as a difference between a setup's two runs, not as a difference
between the setups), a fresh `conveyor up --engine sim --workers 4` (benchmarks/control_plane.py's settings):
- single: on the redis-server `conveyor up` starts itself (appendonly yes), as today;
- cluster: on a LocalRedisCluster (tests/support/redis_cluster.py: 3 masters + 1 replica each, on loopback), with
  `--redis-cluster` (16 partitions), every node set to appendonly yes as the single one is (docs/deploy.md).
Each run measures first an idle window (the services' polling alone: commands/s and CPU with no request), then
the levels of benchmarks/control_plane.py (N client loops streaming greedy requests, every stream checked).

Per level, beside control_plane's figures (tokens/s, pipeline-added TTFT/TPOT, CPU per service, memory): from
EVERY Redis node, INFO commandstats and INFO cpu (used_cpu_sys + used_cpu_user) deltas: commands per token in
total (the masters' sum) and per master with its share, Redis CPU seconds per 1,000 tokens per node (replicas
too: replication costs), each node's top commands. Where the cluster's keys sit (which master holds which
partitions, worker inboxes and gateway reply streams) is recorded with each cluster run.

Run: flock /tmp/conveyor-bench.lock nice -n 5 .venv/bin/python -m benchmarks.redis_cluster --levels 100 1000
Tables for docs/benchmarks.md from a result: .venv/bin/python -m benchmarks.redis_cluster --markdown RESULT.json
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

from benchmarks import control_plane as cp
from benchmarks import control_plane_measure as m
from benchmarks.common import ROOT, ConveyorUp, log_summary, raise_fd_limit, stamp, write_json
from shared.constants import CLUSTER_PARTITIONS, Names
from shared.settings import CommonSettings
from tests.support.redis_cluster import LocalRedisCluster

SERVICES = ["gateway", "tokenizer", "scheduler", "worker"]


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
            if rc:
                partitions = int(env.get("CONVEYOR_REDIS_PARTITIONS", 0)) or CLUSTER_PARTITIONS
                target = cluster_target(rc, Names(CommonSettings().namespace, partitions, cluster=True))
                roles_before = dict(target.roles)
            else:
                target = m.RedisTarget.single(cluster.find_redis_url())
            time.sleep(args.warm)  # every service past its start-up writes
            if rc:
                layout = cluster_layout(rc, target)
            idle = idle_window(cluster, target, args.idle_window)
            print(
                f"idle: {idle['redis_commands_per_s']:.0f} Redis commands/s "
                f"(top {[(k, round(v)) for k, v in idle['redis_top_commands_per_s'][:4]]})",
                flush=True,
            )
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


# --- summary ---------------------------------------------------------------------------------------------------


def avg(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(runs: list[dict], levels: list[int], cores: float) -> dict:
    """Per setup and level, the runs' mean (and each run's tokens/s); per level, cluster / single ratios; and what
    one shard carries at `cores` of one core."""
    out: dict = {}
    for kind in ("single", "cluster"):
        for level in levels:
            ls = [lv for r in runs if r["kind"] == kind for lv in r["levels"] if lv["streams"] == level]
            if not ls:
                continue
            masters = [k for k, n in ls[0]["redis_nodes"].items() if n["role"] == "master"]
            replicas = [k for k, n in ls[0]["redis_nodes"].items() if n["role"] != "master"]
            node = lambda k, f: avg([lv["redis_nodes"][k][f] for lv in ls])  # noqa: E731
            cmds: dict[str, float] = {}
            for lv in ls:
                tokens = max(1, lv["tokens"])
                for name, n in lv["redis_top_commands"]:
                    cmds[name] = cmds.get(name, 0.0) + n / tokens / len(ls)
            s = {
                "runs": len(ls),
                "requests": sum(lv["requests"] for lv in ls),
                "ok": sum(lv["ok"] for lv in ls),
                "failed": sum(lv["failed"] for lv in ls),
                "tokens_per_s_each": [lv["tokens_per_s"] for lv in ls],
                **{
                    k: avg([lv[k] for lv in ls])
                    for k in (
                        "tokens_per_s",
                        "ttft_added_p50",
                        "ttft_added_p99",
                        "tpot_added_p50",
                        "tpot_added_p99",
                        "ttft_p50",
                        "ttft_p99",
                        "tpot_p50",
                        "tpot_p99",
                        "redis_commands_per_token",
                    )
                },
                "cpu_s_per_1k_tokens": {
                    k: avg([lv["cpu_s_per_1k_tokens"].get(k) for lv in ls]) for k in SERVICES + ["client"]
                },
                "redis_top_commands_per_token": sorted(cmds.items(), key=lambda kv: -kv[1])[:8],
                "masters": masters,
                "replicas": replicas,
                "nodes": {
                    k: {f: node(k, f) for f in ("commands_per_token", "share", "cpu_s_per_1k_tokens", "cpu_core_share")}
                    | {"role": ls[0]["redis_nodes"][k]["role"]}
                    for k in masters + replicas
                },
                "redis_cpu_s_per_1k_tokens_masters": sum(node(k, "cpu_s_per_1k_tokens") for k in masters),
                "redis_cpu_s_per_1k_tokens_replicas": sum(node(k, "cpu_s_per_1k_tokens") for k in replicas),
            }
            out.setdefault(kind, {})[str(level)] = s  # str: as JSON keys are
            # Services: cores used during the level, and per request beyond the idle polling (the idle window's)
            idle = [r["idle_window"]["cpu_core_share"] for r in runs if r["kind"] == kind]
            s["requests_per_s"] = avg([lv["ok"] / lv["duration_s"] for lv in ls])
            s["service_cores"] = {k: avg([lv["cpu_s"].get(k, 0.0) / lv["duration_s"] for lv in ls]) for k in SERVICES}
            s["service_idle_cores"] = {k: avg([i.get(k, 0.0) for i in idle]) for k in SERVICES}
            s["service_ms_per_request"] = {
                k: (s["service_cores"][k] - s["service_idle_cores"][k]) / s["requests_per_s"] * 1000 for k in SERVICES
            }
            s["redis_us_per_command"] = {
                k: node(k, "cpu_s_per_1k_tokens") / node(k, "commands_per_token") * 1000 for k in masters + replicas
            }
            s["redis_cores"] = sum(node(k, "cpu_core_share") for k in masters + replicas)
            out.setdefault(kind, {})[str(level)] = s  # str: as JSON keys are
    # What one shard carries at `cores` of a core, two ways. (a) measured: the masters' Redis CPU per token as
    # measured here; one shard takes 1/masters of it (the busiest more: the whole cluster stops when it is full).
    # (b) the cluster's commands per token priced at the single Redis's CPU per command at the same level: a
    # Redis at 6-10 % of a core spends about twice the CPU per command of one at 25 % (fewer commands per event-
    # loop wake-up), so (a) understates what a busy shard carries.
    for level in levels:
        single = out.get("single", {}).get(str(level))
        for kind in ("single", "cluster"):
            if (s := out.get(kind, {}).get(str(level))) is None:
                continue
            m_, busiest = s["masters"], max(s["masters"], key=lambda k: s["nodes"][k]["cpu_s_per_1k_tokens"])
            busiest_c = max(m_, key=lambda k: s["nodes"][k]["commands_per_token"])
            cap = {
                "cores": cores,
                "busiest_master": busiest,
                "measured_tokens_per_s_per_shard": cores / (s["redis_cpu_s_per_1k_tokens_masters"] / 1000 / len(m_)),
                "measured_tokens_per_s_whole": cores / (s["nodes"][busiest]["cpu_s_per_1k_tokens"] / 1000),
            }
            if single:
                us = single["redis_us_per_command"][single["masters"][0]] / 1e6
                cap.update(
                    us_per_command=us * 1e6,
                    priced_tokens_per_s_per_shard=cores / (us * s["redis_commands_per_token"] / len(m_)),
                    priced_tokens_per_s_whole=cores / (us * s["nodes"][busiest_c]["commands_per_token"]),
                )
            s["capacity"] = cap
    ratios = {}
    for level in levels:
        a, b = out.get("single", {}).get(str(level)), out.get("cluster", {}).get(str(level))
        if a and b:
            ratios[str(level)] = {
                k: (b[k] / a[k] if a[k] and b[k] is not None else None)
                for k in (
                    "tokens_per_s",
                    "redis_commands_per_token",
                    "ttft_added_p50",
                    "ttft_added_p99",
                    "tpot_added_p50",
                    "tpot_added_p99",
                )
            }
            ratios[str(level)]["redis_cpu_s_per_1k_tokens_masters"] = (
                b["redis_cpu_s_per_1k_tokens_masters"] / a["redis_cpu_s_per_1k_tokens_masters"]
            )
    out["ratio_cluster_to_single"] = ratios
    return out


def markdown(data: dict) -> str:
    """The tables of docs/benchmarks.md's section from a result."""
    s, levels = data["summary"], data["args"]["levels"]
    ms = lambda v: "-" if v is None else f"{v * 1000:,.0f}" if v * 1000 >= 100 else f"{v * 1000:.1f}"  # noqa: E731
    num = lambda v, d=2: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
    cols = [(k, str(lv)) for lv in levels for k in ("single", "cluster", "ratio")]
    head = (
        "| | "
        + " | ".join(
            ("1 Redis" if k == "single" else "cluster" if k == "cluster" else "cluster / 1") + f", {int(lv):,}"
            for k, lv in cols
        )
        + " |"
    )
    lines = [head, "|---" * (len(cols) + 1) + "|"]

    def row(name, f, ratio=None):
        cells = []
        for k, lv in cols:
            if k == "ratio":
                r = s["ratio_cluster_to_single"].get(lv, {}).get(ratio) if ratio else None
                cells.append("-" if r is None else f"{r:.2f}")
            else:
                x = s.get(k, {}).get(lv)
                cells.append(f(x) if x else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("streams ok / failed", lambda x: f"{x['ok']:,} / {x['failed']:,}")
    row("tokens/s delivered (mean)", lambda x: f"{x['tokens_per_s']:,.0f}", "tokens_per_s")
    row("tokens/s, each run", lambda x: ", ".join(f"{v:,.0f}" for v in x["tokens_per_s_each"]))
    row("TTFT added p50 / p99 ms", lambda x: f"{ms(x['ttft_added_p50'])} / {ms(x['ttft_added_p99'])}", "ttft_added_p50")
    row("TPOT added p50 / p99 ms", lambda x: f"{ms(x['tpot_added_p50'])} / {ms(x['tpot_added_p99'])}", "tpot_added_p50")
    row("Redis commands / token (masters)", lambda x: num(x["redis_commands_per_token"]), "redis_commands_per_token")
    row(
        "... per master (share)",
        lambda x: ", ".join(
            f"{k} {num(x['nodes'][k]['commands_per_token'])} ({x['nodes'][k]['share']:.0%})" for k in x["masters"]
        ),
    )
    row(
        "Redis CPU s / 1k tokens, masters",
        lambda x: num(x["redis_cpu_s_per_1k_tokens_masters"], 3),
        "redis_cpu_s_per_1k_tokens_masters",
    )
    row(
        "... per master",
        lambda x: ", ".join(f"{k} {num(x['nodes'][k]['cpu_s_per_1k_tokens'], 3)}" for k in x["masters"]),
    )
    row(
        "... replicas (sum; per replica)",
        lambda x: (
            "-"
            if not x["replicas"]
            else f"{num(x['redis_cpu_s_per_1k_tokens_replicas'], 3)}; "
            + ", ".join(f"{k} {num(x['nodes'][k]['cpu_s_per_1k_tokens'], 3)}" for k in x["replicas"])
        ),
    )
    row(
        "busiest Redis node, share of a core",
        lambda x: next(
            f"{x['nodes'][k]['cpu_core_share']:.0%} ({k})"
            for k in sorted(x["masters"], key=lambda k: -x["nodes"][k]["cpu_core_share"])
        ),
    )
    row(
        "Redis CPU µs / command, masters",
        lambda x: ", ".join(f"{k} {x['redis_us_per_command'][k]:.1f}" for k in x["masters"]),
    )
    row(
        "cores used: services + client + Redis",
        lambda x: (
            f"{sum(x['service_cores'].values()):.2f} + "
            f"{x['cpu_s_per_1k_tokens']['client'] * x['tokens_per_s'] / 1000:.2f} + {x['redis_cores']:.2f}"
        ),
    )
    for svc in SERVICES:
        row(f"CPU s / 1k tokens: {svc}", lambda x, svc=svc: num(x["cpu_s_per_1k_tokens"][svc], 3))
    row("top commands / token", lambda x: ", ".join(f"{k} {v:.2f}" for k, v in x["redis_top_commands_per_token"][:6]))
    for svc in ("tokenizer", "scheduler"):
        row(f"{svc} CPU ms / request (above idle)", lambda x, svc=svc: num(x["service_ms_per_request"][svc]))
    cap = lambda x, k: "-" if k not in x["capacity"] else f"{x['capacity'][k]:,.0f}"  # noqa: E731
    row(
        "tokens/s a shard carries at 80 % of a core: measured CPU / token",
        lambda x: cap(x, "measured_tokens_per_s_per_shard"),
    )
    row("... whole Redis, until its busiest master is there", lambda x: cap(x, "measured_tokens_per_s_whole"))
    row(
        "tokens/s a shard carries: commands / token at 1 Redis's µs / command",
        lambda x: cap(x, "priced_tokens_per_s_per_shard"),
    )
    row("... whole Redis, until its busiest master is there", lambda x: cap(x, "priced_tokens_per_s_whole"))
    return "\n".join(
        lines + ["", idle_table(data), "", node_table(data, str(levels[-1])), "", command_diff_table(data, levels)]
    )


def masters_commands_per_token(data: dict, kind: str, level: str) -> dict[str, float]:
    """Every command's calls per token on the masters, the runs of a setup at a level pooled."""
    ls = [lv for r in data["runs"] if r["kind"] == kind for lv in r["levels"] if str(lv["streams"]) == level]
    out: dict[str, float] = {}
    for lv in ls:
        for n in lv["redis_nodes"].values():
            if n["role"] == "master":
                for name, calls in n["top_commands"]:
                    out[name] = out.get(name, 0.0) + calls / max(1, lv["tokens"]) / len(ls)
    return out


def command_diff_table(data: dict, levels: list, top: int = 14) -> str:
    """Commands per token on the masters, 1 Redis and cluster, the largest differences first: where the cluster's
    extra commands come from."""
    per = {(k, str(lv)): masters_commands_per_token(data, k, str(lv)) for k in ("single", "cluster") for lv in levels}
    last = str(levels[-1])
    names = sorted(
        {c for d in per.values() for c in d},
        key=lambda c: -abs(per[("cluster", last)].get(c, 0) - per[("single", last)].get(c, 0)),
    )
    head = (
        "| command / token (masters) | "
        + " | ".join(f"1 Redis, {int(lv):,} | cluster, {int(lv):,}" for lv in levels)
        + " |"
    )
    lines = [head, "|---" * (1 + 2 * len(levels)) + "|"]
    for c in names[:top]:
        lines.append(
            f"| {c} | "
            + " | ".join(
                f"{per[('single', str(lv))].get(c, 0):.2f} | {per[('cluster', str(lv))].get(c, 0):.2f}" for lv in levels
            )
            + " |"
        )
    lines.append(
        "| all | "
        + " | ".join(
            f"{sum(per[('single', str(lv))].values()):.2f} | {sum(per[('cluster', str(lv))].values()):.2f}"
            for lv in levels
        )
        + " |"
    )
    return "\n".join(lines)


def idle_table(data: dict) -> str:
    """Each run's idle window: Redis commands/s (and the top ones), Redis and services' CPU, no request."""
    lines = [
        "| idle, no request | Redis commands/s | top commands/s | Redis CPU, share of a core (all nodes) | "
        "tokenizer / scheduler / workers / gateway CPU |",
        "|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        w = r["idle_window"]
        cpu = w["cpu_core_share"]
        lines.append(
            f"| run {r['run']}, {'1 Redis' if r['kind'] == 'single' else 'cluster'} | "
            f"{w['redis_commands_per_s']:,.0f} | "
            + ", ".join(f"{k} {v:,.0f}" for k, v in w["redis_top_commands_per_s"][:5])
            + " | "
            + f"{sum(w['redis_cpu_core_share'].values()):.1%} | "
            + " / ".join(f"{cpu.get(k, 0):.1%}" for k in ("tokenizer", "scheduler", "worker", "gateway"))
            + " |"
        )
    return "\n".join(lines)


def node_table(data: dict, level: str) -> str:
    """Per Redis node at one level (the runs of a setup pooled): commands per token, the top ones, CPU."""
    lines = [
        f"| {int(level):,} streams | commands / token | top commands / token | CPU s / 1k tokens |",
        "|---|---|---|---|",
    ]
    for kind in ("single", "cluster"):
        ls = [lv for r in data["runs"] if r["kind"] == kind for lv in r["levels"] if str(lv["streams"]) == level]
        if not ls:
            continue
        for label in ls[0]["redis_nodes"]:
            per: dict[str, float] = {}
            for lv in ls:
                for name, n in lv["redis_nodes"][label]["top_commands"]:
                    per[name] = per.get(name, 0.0) + n / max(1, lv["tokens"]) / len(ls)
            n = [lv["redis_nodes"][label] for lv in ls]
            lines.append(
                f"| {'1 Redis' if kind == 'single' else 'cluster ' + label} ({n[0]['role']}) | "
                f"{avg([x['commands_per_token'] for x in n]):.2f} | "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:6])
                + f" | {avg([x['cpu_s_per_1k_tokens'] for x in n]):.3f} |"
            )
    return "\n".join(lines)


def print_summary(data: dict) -> None:
    print("\n" + markdown(data))
    for r in data["runs"]:
        print(
            f"\nrun {r['run']} {r['kind']}: idle {r['idle_window']['redis_commands_per_s']:.0f} commands/s, "
            f"server log {r['server_log']['lines']} warnings/errors {r['server_log']['top'][:3]}"
        )
        if r["kind"] == "cluster":
            print(f"  failover: {r['failover']}, node log: {r['node_log'] or 'quiet'}")
            for label, lay in r["layout"].items():
                print(
                    f"  {label}: partitions {lay['partitions']}, worker inboxes {lay['worker_inboxes']}, "
                    f"gateway reply streams {lay['gateway_reply_streams']}, {lay['shared']}"
                )


# --- main ------------------------------------------------------------------------------------------------------


def main() -> None:
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
    args = ap.parse_args()
    if args.markdown:  # the summary recomputed from the runs: a result of an older version gets today's tables
        data = json.loads(args.markdown.read_text())
        data["summary"] = summarize(data["runs"], data["args"]["levels"], data["args"].get("capacity_cores", 0.8))
        print_summary(data)
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
