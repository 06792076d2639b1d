"""Outside clients (the OpenAI Agents SDK, lm-eval, ...) in venvs of their own under ~/.cache/conveyor-peers/<name>,
never in Conveyor's dependencies (their pins may clash with ours: openai-agents wants websockets<17). Made once, by
the first test that needs one, and kept; a test whose client cannot be installed (no registry reachable) is skipped
with the reason.

reuse_runtime: the venv also sees this environment's installed packages (torch, transformers) through a .pth entry,
so that nothing that large is downloaded again; the venv's own site-packages come first, so what the client pins
there wins. Without it the venv is alone (a client whose pins clash with ours)."""

from __future__ import annotations

import fcntl
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(os.environ.get("CONVEYOR_PEERS_DIR", Path.home() / ".cache" / "conveyor-peers"))
INSTALL_TIMEOUT_S = 1200


def _ready(python: Path, requirement: str, module: str | None) -> bool:
    """Whether the venv's python has exactly the pinned distribution (`name==version`) and `module` imports."""
    if not python.exists():
        return False
    name, version = requirement.split("==")
    probe = f"import importlib.metadata as m, sys; sys.exit(m.version({name!r}) != {version!r})"
    if module:
        probe += f"; import {module}"
    return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=300).returncode == 0


def _run(step: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(step, 1, "", f"timed out after {INSTALL_TIMEOUT_S} s")


def _link_runtime(venv: Path) -> None:
    """Point the venv at this runtime's packages (the .pth of reuse_runtime)."""
    pth = next(venv.glob("lib/python*/site-packages")) / "conveyor-runtime.pth"
    pth.write_text("\n".join(site.getsitepackages()) + "\n")


def peer_python(name: str, requirement: str, module: str | None = None, reuse_runtime: bool = False) -> Path:
    """The python of the venv `name` with `requirement` (pinned: `dist==version`) installed and `module` importable,
    made if need be (one maker at a time: a lock file beside it); skips the test when it cannot be made."""
    venv, python = PEERS / name, PEERS / name / "bin" / "python"
    PEERS.mkdir(parents=True, exist_ok=True)
    with open(PEERS / f"{name}.lock", "w") as lock:  # parallel test processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if reuse_runtime and python.exists():
            _link_runtime(venv)  # made by another clone's runtime, perhaps since removed: this one's now
        if _ready(python, requirement, module):
            return python
        shutil.rmtree(venv, ignore_errors=True)
        done = _run([sys._base_executable, "-m", "venv", str(venv)])
        if done.returncode == 0 and reuse_runtime:
            _link_runtime(venv)
        if done.returncode == 0:
            # --no-compile: no .pyc for the hundreds of modules the client never imports (CPU the suite's other
            # process needs); what it imports is compiled at its first import
            done = _run(
                [str(python), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", requirement]
            )
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.skip(f"{requirement} cannot be installed in {venv}: {done.stderr.strip()[-500:]}")
        if not _ready(python, requirement, module):
            pytest.skip(f"{requirement} installed in {venv}, but not importable there")
    return python
