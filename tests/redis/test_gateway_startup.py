"""What a gateway sets up to stay responsive with thousands of connections (issue 12): a listen backlog for a
burst of connects, and the objects loaded at startup kept out of the cyclic collector's full passes."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

from services.gateway.edge import server
from services.gateway.app import create_app
from shared.settings import GatewaySettings
from tests.support.cache import CACHE_DIR


def test_the_gateway_listens_with_the_configured_backlog(monkeypatch):
    seen = []
    monkeypatch.setattr(server.GracefulServer, "run", lambda self: seen.append(self.config.backlog))
    server.serve(object(), GatewaySettings(listen_backlog=5000))
    assert seen == [5000]


def _gateway_config(monkeypatch):
    seen = []
    monkeypatch.setattr(server.GracefulServer, "run", lambda self: seen.append(self.config))
    server.serve(create_app(GatewaySettings(cache_dir=CACHE_DIR)), GatewaySettings())
    return seen[0]


def test_the_gateway_serves_on_uvloop_and_httptools(monkeypatch):
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = _gateway_config(monkeypatch)
    config.load()
    loop = config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    assert config.http_protocol_class is HttpToolsProtocol


def test_a_gateway_without_uvloop_or_httptools_refuses_to_start_rather_than_run_slower(monkeypatch):
    config = _gateway_config(monkeypatch)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: importing it raises
    monkeypatch.setitem(sys.modules, "httptools", None)
    for name in [m for m in sys.modules if m.startswith(("uvicorn.loops.uvloop", "uvicorn.protocols.http.httptools"))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError):
        config.get_loop_factory()
    with pytest.raises(ImportError):
        config.load()


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
