"""What a gateway sets up to stay responsive with thousands of connections (issue 12): a listen backlog for a
burst of connects, and the objects loaded at startup kept out of the cyclic collector's full passes."""

from __future__ import annotations

import asyncio
import gc

from services.gateway.edge import server
from services.gateway.app import create_app
from shared.settings import GatewaySettings
from tests.support.cache import CACHE_DIR


def test_the_gateway_listens_with_the_configured_backlog(monkeypatch):
    seen = []
    monkeypatch.setattr(server.GracefulServer, "run", lambda self: seen.append(self.config.backlog))
    server.serve(object(), GatewaySettings(listen_backlog=5000))
    assert seen == [5000]


def test_the_default_backlog_takes_a_burst_of_thousands_of_connects():
    assert GatewaySettings().listen_backlog >= 5000  # uvicorn's own default, 2048, dropped SYNs of a 5,000 burst


def test_a_started_gateway_keeps_its_startup_objects_out_of_garbage_collection(redis_server, names):
    app = create_app(GatewaySettings(redis_url=redis_server.url, namespace=names.ns, cache_dir=CACHE_DIR))

    async def run() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    try:
        assert asyncio.run(run()) > 100_000  # the tokenizer and the app: a full collection no longer scans them
    finally:
        gc.unfreeze()
