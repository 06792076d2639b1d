"""Outside clients (lm-eval, ...) in virtual environments of their own under ~/.cache/conveyor-peers/<name>,
never in Conveyor's dependencies: created by the test that needs one, at a pinned version, reusing the runtime
environment's already installed packages (torch, transformers) through a .pth entry so that nothing that large is
downloaded again; the venv's own site-packages come first, so what the client pins there wins."""

from __future__ import annotations

import fcntl
import logging
import site
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PEERS = Path.home() / ".cache" / "conveyor-peers"
INSTALL_TIMEOUT_S = 1200


def peer_python(name: str, requirement: str, module: str) -> tuple[Path | None, str]:
    """-> (the venv's python, "") once `module` imports there, else (None, why it could not be installed)."""
    venv = PEERS / name
    py = venv / "bin" / "python"
    PEERS.mkdir(parents=True, exist_ok=True)
    with open(PEERS / f"{name}.lock", "w") as lock:  # one creator at a time (parallel test processes)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _imports(py, module):
            return py, ""
        try:
            if not py.exists():
                subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=300)
                pth = next(venv.glob("lib/python*/site-packages")) / "conveyor-runtime.pth"
                pth.write_text("\n".join(site.getsitepackages()) + "\n")
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", requirement],
                check=True,
                timeout=INSTALL_TIMEOUT_S,
                capture_output=True,
                text=True,
            )
        except (subprocess.SubprocessError, OSError, StopIteration) as e:
            out = getattr(e, "stderr", "") or ""
            return None, f"{requirement} could not be installed in {venv}: {e} {out[-500:]}"
        if not _imports(py, module):
            return None, f"{requirement} installed in {venv} but `import {module}` fails"
        return py, ""


def _imports(py: Path, module: str) -> bool:
    if not py.exists():
        return False
    return subprocess.run([str(py), "-c", f"import {module}"], capture_output=True, timeout=300).returncode == 0
