"""The Redis Cluster benchmark's report (benchmarks/scale/redis_cluster_report.py) reads the same from one run to the next."""

from __future__ import annotations

from benchmarks.scale.redis_cluster_report import command_diff_table

COMMANDS = [f"cmd{i:02d}" for i in range(12)]


def _data() -> dict:
    """One run of each setup at one level, every command called as often on both: all differences tie at 0."""
    node = {"role": "master", "top_commands": [(c, 10) for c in reversed(COMMANDS)]}
    level = {"streams": 100, "tokens": 100, "redis_nodes": {"n1": node}}
    return {"runs": [{"kind": k, "levels": [level]} for k in ("single", "cluster")]}


def test_commands_whose_differences_tie_are_listed_by_name():
    rows = command_diff_table(_data(), [100], top=len(COMMANDS)).splitlines()[2:-1]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == COMMANDS
