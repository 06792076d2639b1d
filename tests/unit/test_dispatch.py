"""shared/wire/dispatch.py: a service loop's event type -> handler table."""

from __future__ import annotations

import pytest

from shared.wire.dispatch import TypeDispatcher
from shared.wire.events import CancelRequested, HandBack, KvResyncRequested


def test_each_event_goes_to_the_handler_of_its_type():
    seen = []
    table = TypeDispatcher(
        {
            CancelRequested: lambda ev: seen.append(("cancel", ev.request_id)),
            KvResyncRequested: lambda ev: seen.append(("resync", ev.worker_id)),
        }
    )
    table(CancelRequested(request_id="r1", reason="client_cancel"))
    table(KvResyncRequested(worker_id="w1", reason="gap"))
    assert seen == [("cancel", "r1"), ("resync", "w1")]


def test_a_type_without_a_handler_is_told_apart_and_refused():
    table = TypeDispatcher({CancelRequested: lambda ev: None})
    assert table.handles(CancelRequested(request_id="r", reason="timeout"))
    assert not table.handles(KvResyncRequested(worker_id="w", reason="gap"))
    with pytest.raises(TypeError):
        table(HandBack.__new__(HandBack))
