"""glibc's malloc on transparent huge pages: GLIBC_TUNABLES=glibc.malloc.hugetlb=1, which glibc reads only as a
process starts, so a service started without it starts itself again with it (shared/settings environment.py says
why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import CommonSettings, start_environment
from shared.settings.environment import GLIBC_TUNABLES, RESTARTED

# `conveyor scheduler` as a command line, up to the import of the scheduler's module; says what it ran under.
PROBE = """
import importlib, json, os, sys
from services import cli
print(json.dumps({"started": os.getpid()}), flush=True)
real = importlib.import_module
def seen(name, *a, **k):
    if not name.startswith("services."):
        return real(name, *a, **k)
    print(json.dumps({"pid": os.getpid(), "tunables": os.environ.get("GLIBC_TUNABLES")}), flush=True)
    raise SystemExit(0)
importlib.import_module = seen
sys.argv = ["conveyor", "scheduler"]
cli.main()
"""

# Memory a Python program mallocs and writes, and how much of its process's memory is on huge pages then.
ALLOCATE = """
block = bytearray(b"x") * (64 << 20)
rollup = open("/proc/self/smaps_rollup").read().splitlines()
print(sum(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")))
"""


def _env(**values: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in (GLIBC_TUNABLES, RESTARTED, "CONVEYOR_MALLOC_HUGE_PAGES")}
    return {**base, **values}


def _probe(**env: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=_env(**env), capture_output=True, text=True, timeout=60, check=True
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _thp_in_use() -> str | None:
    """Why huge pages cannot be asked for here (None: they can)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        return "transparent huge pages are off in this kernel"
    version = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else ""
    if not version.startswith("glibc "):
        return f"not glibc ({version or 'unknown C library'})"
    if tuple(int(x) for x in version.split()[1].split(".")[:2]) < (2, 35):
        return f"{version} has no glibc.malloc.hugetlb (2.35+)"
    return None


def test_a_service_started_as_a_command_starts_itself_again_with_malloc_on_huge_pages():
    lines = _probe()
    assert [next(iter(x)) for x in lines] == ["started", "started", "pid"]  # two starts, then the service's module
    assert lines[0]["started"] == lines[1]["started"] == lines[2]["pid"]  # the same process: one PID to watch
    assert lines[2]["tunables"] == "glibc.malloc.hugetlb=1"


def test_a_service_started_with_the_tunable_starts_once():
    lines = _probe(GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    assert [next(iter(x)) for x in lines] == ["started", "pid"]


def test_the_setting_off_starts_a_service_once_without_the_tunable():
    lines = _probe(CONVEYOR_MALLOC_HUGE_PAGES="false")
    assert [next(iter(x)) for x in lines] == ["started", "pid"] and lines[1]["tunables"] is None


def test_tunables_already_set_are_kept_beside_hugetlb(monkeypatch):
    monkeypatch.delenv(RESTARTED, raising=False)
    monkeypatch.setenv(GLIBC_TUNABLES, "glibc.malloc.arena_max=2")
    assert start_environment(True) == {GLIBC_TUNABLES: "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


def test_a_hugetlb_choice_of_the_environment_is_left_alone(monkeypatch):
    monkeypatch.delenv(RESTARTED, raising=False)
    monkeypatch.setenv(GLIBC_TUNABLES, "glibc.malloc.hugetlb=0")
    assert start_environment(True) == {}


def test_a_process_started_again_never_asks_for_a_third_start(monkeypatch):
    """A loader that dropped the tunable (glibc's, for a setuid program) must not make a service start for ever."""
    monkeypatch.delenv(GLIBC_TUNABLES, raising=False)
    monkeypatch.setenv(RESTARTED, "1")
    assert CommonSettings().start_environment() == {}


def test_malloc_under_the_tunable_takes_huge_pages():
    if why := _thp_in_use():
        pytest.skip(why)
    run = [sys.executable, "-c", ALLOCATE]
    with_it = subprocess.run(run, env=_env(GLIBC_TUNABLES="glibc.malloc.hugetlb=1"), capture_output=True, text=True)
    assert int(with_it.stdout) >= 32 << 10  # kB: at least half of the 64 MB block
