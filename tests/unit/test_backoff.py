"""The one backoff (shared/process/backoff.py) and the one service table (shared/process/service_table.py)."""

from __future__ import annotations

from services.cli import SERVICE_NAMES
from shared.process.backoff import REDIS_CAP_S, backoff_s
from shared.process.service_table import BUS_SERVICES, SERVICES


def test_the_pause_doubles_from_its_base_up_to_its_cap():
    assert [backoff_s(n) for n in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, REDIS_CAP_S]
    assert [backoff_s(n, 1.0, 30.0) for n in (0, 1, 4, 5, 10_000)] == [1.0, 2.0, 16.0, 30.0, 30.0]
    assert backoff_s(-1) == 0.05


def test_every_service_is_named_once_with_the_gateway_started_last():
    assert list(SERVICES)[-1] == "gateway" and set(SERVICE_NAMES) == set(SERVICES)
    assert BUS_SERVICES == ("tokenizer", "scheduler", "worker")
    assert all(spec.entry for spec in SERVICES.values() if not spec.http)
