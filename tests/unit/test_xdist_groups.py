"""`make test`'s `-n N --dist loadgroup`: the tests of one xdist_group run in one process (a cluster started once,
the engine's models loaded once), whatever the versions of pytest and pytest-xdist do with node ids."""

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
