"""`conveyor health SERVICE`, the containers' healthcheck: exit 0 only while this host's own process of SERVICE
has its liveness entry live, read from the health file that process writes after each liveness write
(shared/process/health_file.py), by a probe that imports neither redis-py nor the settings (0.4-0.6 s of CPU a probe)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from shared.process import health_file

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))
HEAVY = ("redis", "pydantic", "pydantic_settings", "opentelemetry", "fastapi", "torch", "msgspec")


def probe(service: str, folder: Path | str) -> subprocess.CompletedProcess:
    cmd = [CONVEYOR, "health", service, "--dir", str(folder)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_worker_whose_entry_is_live_is_healthy(tmp_path):
    health_file.write(str(tmp_path), "worker", time.time() + 30)
    done = probe("worker", tmp_path)
    assert done.returncode == 0, done.stdout


def test_a_worker_whose_entry_lapsed_is_unhealthy(tmp_path):
    health_file.write(str(tmp_path), "worker", time.time() - 1)
    done = probe("worker", tmp_path)
    assert done.returncode == 1 and "lapsed" in done.stdout


def test_a_tokenizer_that_never_wrote_its_entry_is_unhealthy(tmp_path):
    health_file.write(str(tmp_path), "worker", time.time() + 30)  # another service's file says nothing of it
    done = probe("tokenizer", tmp_path)
    assert done.returncode == 1 and "none yet" in done.stdout


def test_the_probe_says_so_when_its_health_folder_is_empty():
    done = probe("gateway", "")
    assert done.returncode == 1 and "no health folder given" in done.stdout


def test_the_probe_imports_neither_redis_nor_the_settings(tmp_path):
    health_file.write(str(tmp_path), "scheduler", time.time() + 30)
    code = (
        f"import sys; from services.cli import main; rc = main(['health', 'scheduler', '--dir', {str(tmp_path)!r}]); "
        f"print(rc, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout + done.stderr
