"""The outside clients' venvs (tests/support/peer_venv.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import peer_venv


def test_a_peer_venv_made_by_a_runtime_since_removed_sees_this_runtime(tmp_path, monkeypatch):
    """A venv that reuses the runtime's packages, made from a clone since deleted (its .pth names a folder that is
    gone), finds this runtime's packages again: its client is there (lm_eval imports), the runtime's torch and
    numpy, which it imports later, must be too."""
    monkeypatch.setattr(peer_venv, "PEERS", tmp_path)
    venv = tmp_path / "client"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = next(venv.glob("lib/python*/site-packages"))
    (site_dir / "conveyor-runtime.pth").write_text("/tmp/a-clone-since-removed/.venv/lib/site-packages\n")
    own = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]
    assert peer_venv.peer_python("client", f"pip=={own}", "pip", reuse_runtime=True) == python
    assert subprocess.run([str(python), "-c", "import torch, numpy"], capture_output=True).returncode == 0
