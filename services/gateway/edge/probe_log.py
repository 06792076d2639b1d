"""Probes in the access log: a poll of /ready or /health is logged when its answer differs from the last one's.

The launcher polls /ready every 0.5 s while the services start (and a load balancer or Kubernetes polls both for
as long as the gateway runs): every poll was an access line, a start left a screen of `GET /ready 503` in the log
and a day of probes buried the requests. What matters of a probe is when its answer changes (503 while the
services start, 200 once ready, 503 again when a worker dies or the gateway drains), and those lines stay.
"""

from __future__ import annotations

import logging

PROBES = ("/health", "/ready")
ACCESS_LOGGER = "uvicorn.access"


class ProbeChanges(logging.Filter):
    """Lets a probe's access line through when its status differs from that probe's last; every other line."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, object] = {}  # probe path -> its last status

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn's: client, method, path, http version, status
            return True
        path = str(args[2]).split("?", 1)[0]
        if path not in PROBES:
            return True
        last, self._last[path] = self._last.get(path), args[4]
        return last != args[4]


def install() -> None:
    """Filter uvicorn's access logger from now on, a new app's probes from no last answer (one filter a process: an
    app made later, as in the tests, replaces the earlier one's)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, ProbeChanges)]:
        logger.removeFilter(old)
    logger.addFilter(ProbeChanges())
