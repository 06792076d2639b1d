"""Fixtures shared by the whole suite: the real model folder, real Redis servers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model_files import resolve_model_dir

# tests/docker builds an image and starts a compose cluster (minutes): `make test-docker` runs it, `make test` not.
collect_ignore = [] if os.environ.get("CONVEYOR_DOCKER_TESTS") else ["docker"]

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
def redis_cluster(tmp_path):
    """A Redis Cluster of this test's own: 3 masters with a replica each (tests/redis_cluster.py; ~2 s to create).
    Skipped, saying why, where no redis-server or redis-cli can be found."""
    from shared.errors import FatalError
    from tests.redis_cluster import LocalRedisCluster

    try:
        LocalRedisCluster.binaries()
    except FatalError as e:
        pytest.skip(f"no Redis Cluster for this test: {e}")
    cluster = LocalRedisCluster(tmp_path / "redis-cluster").start()
    yield cluster
    cluster.stop()


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


@pytest.fixture(scope="session")
def hf_reference(model_dir):
    """transformers' own greedy generation, one prompt at a time, for token-for-token comparisons."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cache: dict = {}

    def prompt_ids(prompt: str | None = None, messages: list | None = None) -> list[int]:
        if messages is not None:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt)

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    generate.prompt_ids = prompt_ids
    generate.tokenizer = tok
    generate.model = model  # float32, for tests that need its logits
    return generate


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, model_dir):
    """One worker and one of each other service, shared by the end-to-end tests that harm nothing.
    Tests that kill or stop processes start a cluster of their own."""
    from tests.cluster import Cluster

    if os.environ.get("CONVEYOR_TEST_REDIS_CLUSTER") == "1":  # the same tests on a Redis Cluster (issue 16)
        from tests.redis_cluster import LocalRedisCluster

        rc = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
        c = Cluster(tmp_path_factory.mktemp("cluster"), CACHE_DIR, redis_url=rc.url, redis_cluster=True).start()
        yield c
        c.stop()
        rc.stop()
        return
    c = Cluster(tmp_path_factory.mktemp("cluster"), CACHE_DIR).start()
    yield c
    c.stop()
