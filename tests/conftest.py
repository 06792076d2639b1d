"""Fixtures shared by the whole suite: the real model folder, real Redis servers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model_files import resolve_model_dir

# One conversion cache for the whole run (and across runs on the same machine).
CACHE_DIR = Path(os.environ.get("CONVEYOR_CACHE_DIR", str(Path.home() / ".cache" / "conveyor")))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted from GGUF once."""
    return resolve_model_dir("", CACHE_DIR)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of this test's own, on a free port."""
    from shared.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture
def names():
    """Fresh stream and key names for this test."""
    import uuid

    from shared.constants import Names

    return Names(f"t{uuid.uuid4().hex[:8]}")
