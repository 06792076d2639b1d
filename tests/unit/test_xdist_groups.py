"""`make test`'s `-n N --dist loadgroup`: the tests of one xdist_group run in one process (a cluster started once,
the engine's models loaded once), whatever the versions of pytest and pytest-xdist do with node ids; and the
clusters of those processes share the cores without their thread pools spinning against each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]

GROUPED = """
import json, os, pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps(["grouped", os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""

FREE = """
import json, os, pytest


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps(["free", os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_the_tests_of_one_group_run_in_one_process_and_the_others_spread(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, GroupIds  # noqa: F401\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_free.py").write_text(FREE)
    where = tmp_path / "where.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "."],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        | {"PYTHONPATH": str(REPO), "WHERE": str(where)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    runs = [json.loads(line) for line in where.read_text().splitlines()]
    grouped = {worker for kind, worker in runs if kind == "grouped"}
    assert len(runs) == 12 and len(grouped) == 1, runs
    assert {worker for kind, worker in runs} == {"gw0", "gw1"}, runs  # the rest did spread


def test_a_clusters_services_run_torch_on_one_thread_beside_other_test_processes(tmp_path, monkeypatch):
    """Several test processes' clusters on the same cores: each service's OpenMP team of one thread (two-thread teams
    spinning against each other's made the suite's cluster tests ~10x slower); alone, the machine's default."""
    from tests.support.cluster import Cluster

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert Cluster(tmp_path / "a", tmp_path / "cache").env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert "OMP_NUM_THREADS" not in Cluster(tmp_path / "b", tmp_path / "cache").env
