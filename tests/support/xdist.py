"""Whether this run shares the cores among several test processes (`make test`: pytest-xdist's -n 4 on 2 cores)."""

from __future__ import annotations

import os


def sharing_the_cores() -> bool:
    """Several pytest-xdist processes run at once: torch in each of them, and in their clusters' services, takes
    one thread (tests/conftest.py, tests/support/cluster.py)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
