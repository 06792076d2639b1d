"""A process's health file: until when its liveness entry stays live, for a container healthcheck that costs
milliseconds.

The probe read the liveness hash in Redis itself: importing redis-py (7.x pulls in OpenTelemetry's metrics SDK)
and pydantic-settings cost 0.4-0.6 s of CPU a probe (measured 2026-12-07 on a 2-core Zen 3), four services every
10 s: a tenth of the machine taken from the model. Instead every process writes, after each liveness write Redis
accepted, the time that entry stays live until to <folder>/<service>, and `conveyor health SERVICE` reads it with
the standard library alone. Same meaning: the file's time is ahead exactly while the entry is fresh in Redis.
Several processes of one service in one folder (`conveyor up --workers 2`) share the file: the freshest writer
wins, "some process of SERVICE here is live", as a container holds one.

The folder is the setting health_dir (CONVEYOR_HEALTH_DIR; empty = no files, the default outside containers); the
probe is given it on its command line (docker-compose.yml: `--dir "$CONVEYOR_HEALTH_DIR"`, expanded by the shell),
as importing the settings is the cost it exists to avoid. Standard library only, for the same reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def write(folder: str, service: str, live_until: float) -> None:
    """Atomically (a reader never sees half a number): a file of this process, then renamed over the shared one."""
    path = Path(folder) / service
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{service}.{os.getpid()}")
    tmp.write_text(f"{live_until!r}\n")  # exact: the probe compares it with the clock
    os.replace(tmp, path)


def remove(folder: str, service: str) -> None:
    """A process stopping cleanly: unhealthy at once, as its liveness entry is gone from Redis."""
    (Path(folder) / service).unlink(missing_ok=True)


def check(service: str, folder: str, now: float | None = None) -> tuple[bool, str]:
    """(healthy, a line why): what the probe prints and exits on."""
    if not folder:
        return False, "no health folder given: the services write no health file (their health_dir is empty)"
    path = Path(folder) / service
    try:
        live_until = float(path.read_text())
    except FileNotFoundError:
        return False, f"{path}: none yet (no liveness write of a {service} here has succeeded)"
    except (OSError, ValueError) as e:
        return False, f"{path}: unreadable ({e})"
    left = live_until - (time.time() if now is None else now)
    if left >= 0:
        return True, f"{service} live for {left:.1f} s more ({path})"
    return False, f"{service}: its liveness lapsed {-left:.1f} s ago ({path})"
