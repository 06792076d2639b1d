"""What benchmarks/control_plane.py measures around each level, outside the client: CPU time and RSS of every
service's process tree (psutil), Redis INFO commandstats and memory, the simulated engine's own step times (the
workers' step logs), and /health latency from a separate process (so the client's busy event loop is not
measured with it)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import redis

from benchmarks.common import ConveyorUp, redis_memory
from services.worker.engine.sim_runner import STEP_LOG_COLUMNS
from shared.constants import Names
from shared.lifecycle import TERMINAL, State

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
    for role, p in cluster.processes().items():
        try:
            procs = [p] + p.children(recursive=True) if role != "launcher" else [p]
            secs = sum(c.cpu_times().user + c.cpu_times().system for c in procs)
        except psutil.Error:
            continue
        out[service_of(role)] = out.get(service_of(role), 0.0) + secs
    me = psutil.Process().cpu_times()
    out["client"] = me.user + me.system
    return out


def rss_by_service(cluster: ConveyorUp) -> dict[str, int]:
    out: dict[str, int] = {}
    for role, p in cluster.processes().items():
        try:
            out[service_of(role)] = out.get(service_of(role), 0) + p.memory_info().rss
        except psutil.Error:
            pass
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


def snapshot(cluster: ConveyorUp, redis_url: str) -> dict:
    return {"t": time.time(), "cpu": cpu_by_service(cluster), "rss": rss_by_service(cluster),
            "commands": commandstats(redis_url), "redis": redis_memory(redis_url)}


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
    return {"steps": len(steps), "modelled_s": sum(s["modelled_s"] for s in steps),
            "ttft_p50": weighted_percentile(ttft, 50), "ttft_p99": weighted_percentile(ttft, 99),
            "itl_p50": weighted_percentile(itl, 50), "itl_p99": weighted_percentile(itl, 99),
            "max_decode_batch": max((s["decode_seqs"] for s in steps), default=0)}


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

    def __init__(self, cluster: ConveyorUp, redis_url: str, interval_s: float = 1.0):
        self.cluster, self.redis_url, self.interval_s = cluster, redis_url, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append({"t": time.time(), "rss": rss_by_service(self.cluster),
                                     "redis": redis_memory(self.redis_url), "states": self._states()})
            except (psutil.Error, redis.RedisError):
                continue

    def _states(self) -> dict[str, int]:
        """Live requests per state (the lifecycle's state sets): where requests wait."""
        names, r = Names(), redis.Redis.from_url(self.redis_url, socket_timeout=10)
        try:
            pipe = r.pipeline(transaction=False)
            for s in LIVE_STATES:
                pipe.zcard(names.state_set(0, s))
            return dict(zip(LIVE_STATES, pipe.execute()))
        finally:
            r.close()

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
