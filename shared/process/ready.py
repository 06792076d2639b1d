"""Waiting for an HTTP endpoint to answer 200: `conveyor up` for its gateway's /ready, the benchmarks and the test
clusters for the servers they start.

One client serves every poll: a new one loads the CA bundle for TLS (~35 ms of CPU), which twice a second kept ~8 %
of a core busy beside a worker timing its GEMM kernels at start (docs/benchmarks.md, 2026-12-06).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

logger = logging.getLogger(__name__)


def wait_ok(url: str, timeout_s: float, poll_s: float, check: Callable[[], bool | None] = lambda: None) -> bool:
    """Poll `url` until it answers 200 (True) or timeout_s passes (False). Before each poll `check()` runs: None
    goes on, True or False ends the wait with that answer (the caller knows the server is ready, or gave up); it
    may raise (a server process that died)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if (verdict := check()) is not None:
                return verdict
            try:
                if client.get(url).status_code == 200:
                    return True
            except httpx.HTTPError as e:
                logger.debug("%s not answering yet: %s", url, e)
            time.sleep(poll_s)
    return False
