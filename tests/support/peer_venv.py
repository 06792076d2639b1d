"""Outside clients (the OpenAI Agents SDK, ...) in venvs of their own under ~/.cache/conveyor-peers/<name>, never in
Conveyor's dependencies (their pins may clash with ours: openai-agents wants websockets<17). Made once, by the
first test that needs one, and kept; a test whose client cannot be installed (no registry reachable) is skipped
with the reason."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(os.environ.get("CONVEYOR_PEERS_DIR", Path.home() / ".cache" / "conveyor-peers"))
INSTALL_TIMEOUT_S = 900


def _has(python: Path, requirement: str) -> bool:
    """Whether the venv's python has exactly the pinned distribution (`name==version`)."""
    name, version = requirement.split("==")
    probe = f"import importlib.metadata as m, sys; sys.exit(m.version({name!r}) != {version!r})"
    return python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def peer_python(name: str, requirement: str) -> Path:
    """The python of the venv `name` with `requirement` (pinned: `dist==version`) installed, made if need be (one
    maker at a time: a lock file beside it); skips the test when it cannot be made."""
    venv, python = PEERS / name, PEERS / name / "bin" / "python"
    PEERS.mkdir(parents=True, exist_ok=True)
    with open(PEERS / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _has(python, requirement):
            return python
        shutil.rmtree(venv, ignore_errors=True)
        steps = ([sys.executable, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", "-q", requirement])
        for step in steps:
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                done = subprocess.CompletedProcess(step, 1, "", f"timed out after {INSTALL_TIMEOUT_S} s")
            if done.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                pytest.skip(f"{requirement} cannot be installed in {venv}: {done.stderr.strip()[-500:]}")
        if not _has(python, requirement):
            pytest.skip(f"{requirement} installed in {venv} but not found there")
    return python
