"""shared.process.ready.wait_ok: the one wait for an HTTP endpoint (`conveyor up`, the benchmarks, the test clusters)."""

from __future__ import annotations

import pytest

from shared.process.ready import wait_ok
from shared.redis_io.redis_server import free_port

CLOSED = f"http://127.0.0.1:{free_port()}/ready"  # nothing listens there


def test_a_check_that_answers_ends_the_wait_with_its_answer():
    assert wait_ok(CLOSED, 30.0, 0.01, lambda: True) is True
    assert wait_ok(CLOSED, 30.0, 0.01, lambda: False) is False


def test_an_endpoint_that_never_answers_is_not_ready_once_the_time_is_up():
    assert wait_ok(CLOSED, 0.05, 0.01) is False


def test_a_check_that_raises_ends_the_wait_with_its_error():
    def died() -> None:
        raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_ok(CLOSED, 30.0, 0.01, died)
