"""What every process's log setup (shared.process.runtime.setup_logging) lets through: the HTTP client libraries' line per
request stays out at INFO (the launcher polls /ready every 0.5 s during a start), their warnings stay in."""

from __future__ import annotations

import logging

import pytest

from shared.process.runtime import QUIET_LIBRARIES, setup_logging


@pytest.fixture
def restored_levels():
    loggers = [logging.getLogger(n) for n in ("", *QUIET_LIBRARIES)]
    levels = [x.level for x in loggers]
    yield
    for x, level in zip(loggers, levels):
        x.setLevel(level)


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_the_http_clients_request_lines_are_left_out_and_their_warnings_kept(restored_levels, level):
    logging.getLogger().setLevel(level)  # basicConfig leaves a root with handlers (pytest's) alone: set it here
    setup_logging(level)
    for name in ("httpx", "httpcore"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
