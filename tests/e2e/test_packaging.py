"""What a non-editable install (the Docker image's `pip install .`) carries: the engine's C++ sources and the
dashboard's static files are package data, or a container worker silently runs the slow torch path."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (whl,) = out.glob("conveyor-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def test_the_wheel_carries_every_cpu_kernel_source(wheel_names):
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "services/worker/engine/cpu/csrc").iterdir()}
    assert sources and sources <= wheel_names, sorted(sources - wheel_names)


def test_the_wheel_carries_the_dashboard_files(wheel_names):
    static = {p.relative_to(ROOT).as_posix() for p in (ROOT / "services/gateway/ops/static").iterdir()}
    assert static <= wheel_names, sorted(static - wheel_names)


def test_the_wheel_carries_no_tests_or_benchmarks(wheel_names):
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in wheel_names)
