"""`conveyor up`: a whole local cluster from one command, stopped cleanly by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from shared.redis_server import free_port
from tests.conftest import CACHE_DIR


def test_conveyor_up_serves_then_stops_every_child_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "CONVEYOR_CACHE_DIR": str(CACHE_DIR), "CONVEYOR_KV_CACHE_BYTES": str(128 << 20),
           "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=log, cwd=os.getcwd())
    try:
        line = proc.stdout.readline().decode()  # blocks until ready (or the launcher exits)
        assert f"http://127.0.0.1:{port}" in line, (tmp_path / "up.log").read_text()[-3000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis-server, tokenizer, scheduler, worker, gateway
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
