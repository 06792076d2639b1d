"""What benchmarks/scale/control_plane.py measures around each level, outside the client: CPU time and RSS of every
service's process tree (psutil), Redis INFO commandstats, cpu and memory (of every node, on a Redis Cluster), the
simulated engine's own step times (the workers' step logs), and /health latency from a separate process (so the
client's busy event loop is not measured with it)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import redis

from benchmarks.common import ConveyorUp, cpu_s, each_alive, rss_by_role, tree_cpu_s
from services.worker.engine.sim.sim_runner import STEP_LOG_COLUMNS
from shared.wire.constants import Names
from shared.state.lifecycle import TERMINAL, State

LIVE_STATES = [s.value for s in State if s not in TERMINAL]

# The probe: GET /health on a fresh connection every interval, one JSON line per try (epoch time, seconds
# or null, status or error). Its own process: its latency is the gateway's, not this client's event loop's.
PROBE = """
import http.client, json, sys, time
host, port, interval, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), open(sys.argv[4], "a", buffering=1)
while True:
    t0, t, status = time.time(), time.perf_counter(), None
    try:
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("GET", "/health")
        status = c.getresponse().status
        c.close()
        lat = time.perf_counter() - t
    except Exception as e:
        lat, status = None, type(e).__name__
    out.write(json.dumps([t0, lat, status]) + "\\n")
    time.sleep(max(0.0, interval - (time.perf_counter() - t)))
"""


def service_of(role: str) -> str:
    return "worker" if role.startswith("worker#") else role


def cpu_by_service(cluster: ConveyorUp) -> dict[str, float]:
    """User + system CPU seconds of each service's process tree (the workers summed), now."""
    out: dict[str, float] = {}
    procs = cluster.processes()
    services = {role: p for role, p in procs.items() if role != "launcher"}
    # the launcher's own seconds only: its children are the services, counted as theirs
    trees = each_alive(services, tree_cpu_s) | each_alive({"launcher": procs["launcher"]}, cpu_s)
    for role, secs in trees.items():
        out[service_of(role)] = out.get(service_of(role), 0.0) + secs
    out["client"] = cpu_s(psutil.Process())
    return out


def rss_by_service(cluster: ConveyorUp) -> dict[str, int]:
    out: dict[str, int] = {}
    for role, rss in rss_by_role(cluster.processes()).items():
        out[service_of(role)] = out.get(service_of(role), 0) + rss
    out["client"] = psutil.Process().memory_info().rss
    return out


def commandstats(url: str) -> dict[str, int]:
    """Calls per command since Redis started (commands run inside scripts are counted too)."""
    r = redis.Redis.from_url(url, socket_timeout=10)
    try:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    finally:
        r.close()


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def node_cpu(r: redis.Redis) -> dict[str, float]:
    """CPU seconds a redis-server used since it started (INFO cpu): its own process, and its forked children
    (AOF rewrites, full syncs of a replica)."""
    info = r.info("cpu")
    return {
        "cpu_s": info["used_cpu_sys"] + info["used_cpu_user"],
        "children_cpu_s": info.get("used_cpu_sys_children", 0.0) + info.get("used_cpu_user_children", 0.0),
    }


def node_role(r: redis.Redis) -> str:
    role = r.execute_command("ROLE")[0]
    return role.decode() if isinstance(role, bytes) else role


class RedisTarget:
    """The Redis a run measures: one redis-server, or every node of a Redis Cluster (labels m0.. for its masters,
    r0.. for its replicas). Commands and memory of the whole are the masters' sums (a replica replays its master's
    writes: counted apart, as its CPU is); names.partitions partitions hold the lifecycle's state sets."""

    def __init__(self, nodes: dict[str, str], names: Names | None = None, cluster: bool = False):
        self.nodes, self.names, self.cluster = dict(nodes), names or Names(), cluster
        # one plain client per node, kept: the measuring adds no connection set-up commands to what it counts
        self.clients = {label: redis.Redis.from_url(url, socket_timeout=10) for label, url in self.nodes.items()}
        self.roles = self.current_roles()
        self._client: redis.Redis | None = None

    def current_roles(self) -> dict[str, str]:
        return {label: node_role(c) for label, c in self.clients.items()}

    def _memory(self, label: str) -> dict:
        r = self.clients[label]
        info = r.info("memory")
        return {"used_memory": info["used_memory"], "used_memory_rss": info["used_memory_rss"], "keys": r.dbsize()}

    @classmethod
    def single(cls, url: str) -> "RedisTarget":
        return cls({"redis": url})

    @property
    def masters(self) -> list[str]:
        return [label for label in self.nodes if self.roles[label] == "master"]

    def node_snapshot(self, label: str) -> dict:
        r = self.clients[label]
        commands = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
        return {"role": node_role(r), "commands": commands, **node_cpu(r), **self._memory(label)}

    def snapshot(self) -> dict:
        nodes = {label: self.node_snapshot(label) for label in self.nodes}
        commands: dict[str, int] = {}
        for label in self.masters:
            for k, v in nodes[label]["commands"].items():
                commands[k] = commands.get(k, 0) + v
        return {"commands": commands, "redis": self.memory(nodes), "nodes": nodes}

    def memory(self, nodes: dict | None = None) -> dict:
        """used_memory, used_memory_rss and keys summed over the masters."""
        per = [nodes[label] if nodes else self._memory(label) for label in self.masters]
        return {k: sum(m[k] for m in per) for k in ("used_memory", "used_memory_rss", "keys")}

    def states(self) -> dict[str, int]:
        """Live requests per state (the lifecycle's state sets, summed over the partitions): where requests wait.
        One client kept for the caller's thread (a cluster client learns the topology once)."""
        if self._client is None:
            url = next(iter(self.nodes.values()))
            self._client = (
                redis.RedisCluster.from_url(url, socket_timeout=10)
                if self.cluster
                else redis.Redis.from_url(url, socket_timeout=10)
            )
        pipe = self._client.pipeline(transaction=False)
        for s in LIVE_STATES:
            for p in self.names.all_partitions:
                pipe.zcard(self.names.state_set(p, s))
        counts, n = pipe.execute(), self.names.partitions
        return {s: sum(counts[i * n : (i + 1) * n]) for i, s in enumerate(LIVE_STATES)}


def snapshot(cluster: ConveyorUp, target: RedisTarget) -> dict:
    return {"t": time.time(), "cpu": cpu_by_service(cluster), "rss": rss_by_service(cluster), **target.snapshot()}


def node_figures(before: dict, after: dict, tokens: int) -> dict:
    """Per Redis node over a window: commands (and per token, and the share of the masters' total), CPU seconds
    (per 1,000 tokens, and as a share of one core over the window), the top commands, memory after."""
    secs = max(1e-9, after["t"] - before["t"])
    cmds = {
        label: delta(after["nodes"][label]["commands"], before["nodes"][label]["commands"]) for label in after["nodes"]
    }
    total = sum(sum(c.values()) for label, c in cmds.items() if after["nodes"][label]["role"] == "master") or 1
    out = {}
    for label, a in after["nodes"].items():
        b, n = before["nodes"][label], sum(cmds[label].values())
        cpu = a["cpu_s"] - b["cpu_s"]
        out[label] = {
            "role": a["role"],
            "role_before": b["role"],
            "commands": n,
            "commands_per_token": n / tokens,
            "share": n / total if a["role"] == "master" else None,
            "commands_per_s": n / secs,
            "cpu_s": cpu,
            "cpu_s_per_1k_tokens": cpu / tokens * 1000,
            "cpu_core_share": cpu / secs,
            "children_cpu_s": a["children_cpu_s"] - b["children_cpu_s"],
            "top_commands": sorted(cmds[label].items(), key=lambda kv: -kv[1]),  # all, most first
            "used_memory": a["used_memory"],
            "keys": a["keys"],
        }
    return out


def read_steps(folder: Path, t0: float, t1: float) -> list[dict]:
    """Every worker's simulated steps that ended within [t0, t1] (epoch seconds)."""
    out = []
    for path in folder.glob("sim-steps-*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != len(STEP_LOG_COLUMNS):
                continue  # a line being written
            step = dict(zip(STEP_LOG_COLUMNS, map(float, parts)))
            if t0 <= step["t_end"] <= t1:
                out.append(step)
    return out


def weighted_percentile(pairs: list[tuple[float, float]], p: float) -> float | None:
    """The p-th percentile of values given as (value, weight) pairs (lower value at ties of rank)."""
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in pairs)
    if not total:
        return None
    rank, seen = total * p / 100, 0.0
    for v, w in pairs:
        seen += w
        if seen >= rank:
            return v
    return pairs[-1][0]


def engine_own(steps: list[dict]) -> dict:
    """The engine's own time per token: a decode token's is the modelled time of the step that made it (each
    decoding sequence gets one token per step), a first token's the modelled time of the step that finished
    its prompt (sampled sequences that were not decoding)."""
    itl = [(s["modelled_s"], s["decode_seqs"]) for s in steps]
    ttft = [(s["modelled_s"], s["sampled"] - s["decode_seqs"]) for s in steps]
    return {
        "steps": len(steps),
        "modelled_s": sum(s["modelled_s"] for s in steps),
        "ttft_p50": weighted_percentile(ttft, 50),
        "ttft_p99": weighted_percentile(ttft, 99),
        "itl_p50": weighted_percentile(itl, 50),
        "itl_p99": weighted_percentile(itl, 99),
        "max_decode_batch": max((s["decode_seqs"] for s in steps), default=0),
    }


class HealthProbe:
    """The /health probe process, writing into path."""

    def __init__(self, host: str, port: int, path: Path, interval_s: float):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, host, str(port), str(interval_s), str(path)])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def between(self, t0: float, t1: float) -> list[list]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if t0 <= r[0] <= t1]


class Sampler:
    """RSS of every service and Redis memory every interval, in a thread (the peak within a level)."""

    def __init__(self, cluster: ConveyorUp, target: RedisTarget, interval_s: float = 1.0):
        self.cluster, self.target, self.interval_s = cluster, target, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(
                    {
                        "t": time.time(),
                        "rss": rss_by_service(self.cluster),
                        "redis": self.target.memory(),
                        "states": self.target.states(),
                    }
                )
            except (psutil.Error, redis.RedisError):
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def peak(self, t0: float, t1: float) -> dict:
        window = [s for s in self.samples if t0 <= s["t"] <= t1]
        rss: dict[str, int] = {}
        for s in window:
            for k, v in s["rss"].items():
                rss[k] = max(rss.get(k, 0), v)
        mem = max((s["redis"]["used_memory"] for s in window), default=None)
        states = {k: max(s.get("states", {}).get(k, 0) for s in window) for k in LIVE_STATES} if window else {}
        return {"rss": rss, "redis_used_memory": mem, "max_in_state": states}
