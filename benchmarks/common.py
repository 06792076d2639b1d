"""Helpers the cluster benchmarks share (burst, cpu_contention, overload, soak).

A `conveyor up` cluster as a subprocess, CPU hogs, the model folder, the RSS of a
process tree, Redis memory, and writing results.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import redis

from shared.text.model_files import DEFAULT_MODEL_NAME, resolve_model_dir
from shared.process.ready import wait_ok
from shared.redis_io.redis_server import die_with_parent, free_port
from shared.settings import CommonSettings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results"
# Short chat prompts the cluster benchmarks send (cpu_contention, tracing_overhead): the same in each.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "Why is the sky blue?",
    "Tell me a fun fact about octopuses.",
    "What is photosynthesis?",
    "Give three tips for a job interview.",
]
MODEL_NAME = DEFAULT_MODEL_NAME  # the name both servers answer to
# Settings a benchmark keeps from the caller's environment; every other CONVEYOR_* is dropped so that
# "defaults" means the defaults, not whatever a shell happened to export.
KEPT_SETTINGS = ("CONVEYOR_MODEL", "CONVEYOR_MODEL_NAME", "CONVEYOR_CACHE_DIR")


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def raise_fd_limit() -> int:
    """1,000 clients need > 1,024 sockets on both sides; children (the servers) inherit the raised limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return max(soft, want)


def model_dir() -> Path:
    """The Hugging Face folder of the served model (the safetensors copy `conveyor up` makes of the GGUF)."""
    s = CommonSettings()
    return resolve_model_dir(s.model, s.cache_dir)


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") or k in KEPT_SETTINGS}
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


def median_s(fn, reps: int) -> float:
    """The median wall time of `reps` calls of fn(), in seconds."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [headers] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(out: Path, name: str, data: dict, run_id: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{run_id or stamp()}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def log_summary(path: Path, top: int = 8) -> dict:
    """ERROR/WARNING lines of a server log, counted by message with numbers and ids masked."""
    counts: Counter = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"\b(ERROR|WARNING|CRITICAL)\b(.*)", line)
            if m:
                msg = re.sub(r"[0-9a-f]{16,}|\d+(\.\d+)?", "#", m.group(2).strip())[:160]
                counts[f"{m.group(1)} {msg}"] += 1
    return {"lines": sum(counts.values()), "top": counts.most_common(top)}


def wait_http(url: str, ok, proc: subprocess.Popen, timeout: float, what: str) -> None:
    def check() -> bool | None:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        return True if ok() else None

    if not wait_ok(url, timeout, 0.5, check):
        raise RuntimeError(f"{what} not ready within {timeout:.0f} s")


class ConveyorUp:
    """`conveyor up` as a child process on a free port; stderr (every service's log) goes to log_path."""

    def __init__(
        self,
        log_path: Path,
        workers: int = 1,
        redis_url: str | None = None,
        env: dict | None = None,
        args: list[str] | None = None,
        root: Path = ROOT,
    ):
        """root: the source tree the cluster runs (another checkout, for a before/after comparison)."""
        self.log_path, self.workers, self.redis_url = Path(log_path), workers, redis_url
        self.root = Path(root)
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)  # root's first
        self.env, self.args = clean_env({**(env or {}), "PYTHONPATH": path}), list(args or [])
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> "ConveyorUp":
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
            *(["--redis-url", self.redis_url] if self.redis_url else []),
            *self.args,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        t0 = time.monotonic()
        wait_http(f"{self.url}/ready", self._ready.is_set, self.proc, timeout, "conveyor up")
        print(f"conveyor up ready on {self.url} after {time.monotonic() - t0:.0f} s (log: {self.log_path})", flush=True)
        return self

    def _read_stdout(self) -> None:
        # The launcher prints one line on stdout, "Conveyor is ready: URL", once /ready answers.
        for line in self.proc.stdout:
            if "ready" in line.lower():
                self._ready.set()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # the launcher stops its children (workers drain up to ~35 s)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ConveyorUp":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def processes(self) -> dict[str, psutil.Process]:
        """The launcher and its children by role (gateway, tokenizer, scheduler, worker#i, redis), found afresh
        each call: a child that died and was restarted has a new pid."""
        root = psutil.Process(self.proc.pid)
        out, workers = {"launcher": root}, 0
        for p in sorted(root.children(recursive=True), key=lambda p: p.pid):
            try:
                role = role_of(p.cmdline())
            except psutil.Error:
                continue
            if role == "worker":
                role, workers = f"worker#{workers}", workers + 1
            if role:
                out[role] = p
        return out

    def find_redis_url(self) -> str:
        """The URL of the Redis this cluster uses: the one given, else the redis-server the launcher started."""
        if self.redis_url:
            return self.redis_url
        cmd = self.processes()["redis"].cmdline()
        if "--port" in cmd:
            return f"redis://127.0.0.1:{cmd[cmd.index('--port') + 1]}/0"
        # redis-server retitles itself "redis-server 127.0.0.1:PORT" once started
        port = re.search(r":(\d+)", " ".join(cmd)).group(1)
        return f"redis://127.0.0.1:{port}/0"


def role_of(cmdline: list[str]) -> str | None:
    if "services.cli" in cmdline:
        i = cmdline.index("services.cli")
        return cmdline[i + 1] if i + 1 < len(cmdline) else None
    if cmdline and Path(cmdline[0]).name.startswith("redis-server"):
        return "redis"
    return None


def each_alive(items: dict, read) -> dict:
    """read(value) for each item, by its key; a process that exited since it was listed is left out: what it used
    went with it, and the others' figures are still the sample asked for."""
    out = {}
    for key, value in items.items():
        try:
            out[key] = read(value)
        except psutil.NoSuchProcess:
            continue
    return out


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def tree_cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of a process and every process under it, now."""
    return sum(each_alive(dict(enumerate([proc, *proc.children(recursive=True)])), cpu_s).values())


def rss_by_role(procs: dict[str, psutil.Process]) -> dict[str, int]:
    return each_alive(procs, lambda p: p.memory_info().rss)


def redis_memory(url: str) -> dict:
    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        info = r.info("memory")
        return {"used_memory": info["used_memory"], "used_memory_rss": info["used_memory_rss"], "keys": r.dbsize()}
    finally:
        r.close()


def key_census(url: str, names) -> dict:
    """Redis's keys by family (a request's keys by layer, the request id elided), how many of them have no TTL, and
    the bytes of every key that is not a request's (streams, indexes): what a step in DBSIZE or used_memory is made
    of. SCAN: a benchmark's look, never a server's."""
    r = redis.Redis.from_url(url, socket_timeout=10)
    try:
        keys = [k.decode() for k in r.scan_iter(count=5000)]
        families: Counter = Counter()
        shared_keys = []
        for k in keys:
            if ":req:" in k:
                families["req:" + k.rsplit(":", 1)[-1]] += 1
            else:
                shared_keys.append(k)
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.ttl(k)
        no_ttl = Counter()
        for k, ttl in zip(keys, pipe.execute()):
            if ttl == -1:
                no_ttl["req:" + k.rsplit(":", 1)[-1] if ":req:" in k else "shared"] += 1
        pipe = r.pipeline(transaction=False)
        for k in shared_keys:
            pipe.memory_usage(k)
        sizes = {k.removeprefix(names.ns + ":"): b or 0 for k, b in zip(shared_keys, pipe.execute())}
        return {
            "families": dict(families),
            "no_ttl": dict(no_ttl),
            "shared_bytes": dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:25]),
        }
    finally:
        r.close()


def start_hogs(n: int, nice: int = 0) -> list[subprocess.Popen]:
    """n CPU-bound processes (Python busy loops) beside whatever server runs; they die with this process."""

    def pre() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pre) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.terminate()
    for h in hogs:
        h.wait(timeout=10)


def hogs_cpu_s(hogs: list[subprocess.Popen]) -> float:
    """CPU seconds the hogs have used so far (call before stop_hogs)."""
    return sum(each_alive({h.pid: h.pid for h in hogs}, lambda pid: cpu_s(psutil.Process(pid))).values())
