"""A service process whose instance id would break its key names stops at start, saying which setting (the gateway's
own checks of its id: tests/redis/test_instance_id.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("bad", ["gw:1", "gw{1}", "gw 1"])
def test_an_instance_id_that_breaks_key_names_stops_the_service_at_start(bad, redis_server):
    env = {**os.environ, "CONVEYOR_INSTANCE_ID": bad, "CONVEYOR_REDIS_URL": redis_server.url}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "scheduler"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0
    assert "CONVEYOR_INSTANCE_ID" in out.stderr and repr(bad) in out.stderr, out.stderr[-2000:]
