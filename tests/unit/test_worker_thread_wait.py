"""How a worker's torch threads wait at a barrier: GOMP_SPINCOUNT, set before torch loads (shared/settings
environment.omp_environment says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shared.settings import TokenizerSettings, WorkerSettings, omp_environment

# Runs `conveyor worker`'s start up to the import of the worker's module and says what libgomp would read then.
PROBE = """
import importlib, json, os, sys
from services import cli
real = importlib.import_module
def seen(name, *a, **k):
    if not name.startswith("services."):
        return real(name, *a, **k)
    print(json.dumps({"spin": os.environ.get("GOMP_SPINCOUNT"), "torch": "torch" in sys.modules}))
    raise SystemExit(0)
importlib.import_module = seen
cli.run_service("worker")
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_started_by_the_cli_has_its_spin_count_set_before_torch_loads():
    assert _probe() == {"spin": str(WorkerSettings().omp_spin_count), "torch": False}


def test_a_spin_count_the_environment_sets_is_kept():
    assert _probe(GOMP_SPINCOUNT="5") == {"spin": "5", "torch": False}


def test_a_wait_policy_the_environment_sets_is_not_overridden_by_a_spin_count(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_environment(30_000) == {}


def test_spin_count_zero_leaves_libgomp_its_default(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert omp_environment(0) == {}
    assert omp_environment(1_000) == {"GOMP_SPINCOUNT": "1000"}


def test_services_without_torch_threads_set_no_library_variable():
    assert TokenizerSettings().library_environment() == {}
