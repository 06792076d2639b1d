"""Fixtures shared by the whole suite: the real model folder and its tokenizer, real Redis servers, clusters of real
service processes, the engine's model and references. Helpers the tests import are in tests/support/.

The suite is in tiers, one folder each, marked from here (`-m unit`, `-m "unit or redis"`, ...):
  unit/     pure: no Redis, no process (the model's tokenizer may be loaded)
  redis/    a real redis-server (or Redis Cluster) of the test's own, services' code run in the test's process
  e2e/      real service processes, the real model's weights, clusters over HTTP
  browser/  a headless Chromium against a cluster
  docker/   compose on a Docker engine: `make test-docker` only
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from shared.settings import WorkerSettings
from shared.text.model_files import resolve_model_dir
from tests.support.cache import CACHE_DIR
from tests.support.xdist import sharing_the_cores

# A test process's own torch threads (the engine tests that run a step on two) wait at their barriers as a worker's
# do (shared.settings.omp_environment says why), set before torch loads: make test's four processes share two
# cores, and at libgomp's default a thread spins on for its partner while that partner waits for the core.
os.environ.update(WorkerSettings().library_environment())

# tests/docker builds an image and starts a compose cluster (minutes): `make test-docker` runs it, `make test` not.
collect_ignore = [] if os.environ.get("CONVEYOR_DOCKER_TESTS") else ["docker"]

TESTS = Path(__file__).parent
TIERS = ("unit", "redis", "e2e", "browser")
SHARED_CLUSTERS = ("cluster", "keyed_cluster", "sim_cluster")  # the session's clusters, below


def _xdist_group(item) -> str | None:
    """ "engine" for the engine's own tests; the name of the session's cluster a test uses; its module for a test of
    a module-scoped fixture (a module's cluster, a wheel); None for a test that shares nothing costly."""
    if Path(item.path).parent.name == "engine":
        # The kernels' own tests load no model and compile each ISA variant (~1 min on 2 cores): a process of their
        # own takes that off the engine group's, the suite's longest (17 min 13 s wall with them in it on an AVX2
        # EPYC, 2026-12-03, over the 15 min budget).
        if Path(item.path).name == "test_engine_cpu_kernels.py":
            return "engine-kernels"
        # The engine's own tests run the model in the test's process: in one process, the models are loaded once
        # and held once (spread over four processes they held 6-7 GB each, and the machine ran out of memory).
        return "engine"
    defs = item._fixtureinfo.name2fixturedefs if hasattr(item, "_fixtureinfo") else {}
    for name in SHARED_CLUSTERS:
        if name in defs and defs[name][-1].scope == "session":
            return name
    if any(d[-1].scope in ("module", "package") for d in defs.values()):
        return item.nodeid.split("::")[0]
    return None


def pytest_configure(config):
    """Under pytest-xdist, several test processes share the cores: torch in each (the engine's own tests, the
    references) runs on one thread, or their thread pools oversubscribe the machine and every step waits on the
    others' spinning threads (engine tests took minutes and timed out so). The services' processes keep their
    default (their GEMM plans on disk are measured for it)."""
    if sharing_the_cores():
        import torch

        torch.set_num_threads(1)
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker of `--dist loadgroup`
        config.pluginmanager.register(GroupIds(), "conveyor-xdist-group-ids")


class GroupIds:
    """--dist loadgroup sends the tests of one xdist_group to one process by the `@group` suffix of their node ids,
    which pytest-xdist 3.8 appends by assigning `item._nodeid`: pytest 9.2 keeps node ids in `item._id`, so nothing
    was appended, every test was scheduled alone and each process started the clusters and loaded the models of
    every group (and ran out of memory). The suffix is appended here, after xdist's hook, where it is missing."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        from _pytest.nodeid import NodeId

        for item in items:
            groups = sorted(
                {
                    str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")
                }
            )
            suffix = "@" + "_".join(groups)
            if groups and not item.nodeid.endswith(suffix):
                item._id = NodeId.parse(item.nodeid + suffix)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier, the folder it is in. Under pytest-xdist (`-n N --dist loadgroup`, as
    `make test` runs), the tests of a cluster run in one process: those of the shared `cluster` together, those of
    an e2e or browser module with a module-scoped fixture together (its cluster is started once); every other test
    goes on its own to whichever process is free."""
    for item in items:
        try:
            tier = Path(item.path).relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier not in TIERS:
            continue
        item.add_marker(getattr(pytest.mark, tier))
        if tier in ("e2e", "browser") and not item.get_closest_marker("xdist_group"):
            if group := _xdist_group(item):
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted from GGUF once."""
    return resolve_model_dir("", CACHE_DIR)


@pytest.fixture(scope="session")
def kernels_dir() -> str:
    """Where the engine's C++ kernels are built for the tests: the cache directory the clusters' workers and the
    engine's own tests (tuning_cache_dir None) build in, so that each variant is compiled once per machine (a
    folder of their own built the CPU's best variant twice: ~35 s on 2 cores)."""
    return str(CACHE_DIR)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    """The served model's tokenizer (transformers' AutoTokenizer, as the services load it)."""
    from shared.text.tokenization import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def token_strings(tokenizer):
    """The gateway's token-to-text table of the served tokenizer (logprobs' `token` and `bytes`)."""
    from services.gateway.text.logprobs import TokenStrings

    return TokenStrings(tokenizer)


@pytest.fixture(scope="session")
def vocab(model_dir):
    """The simulated engine's vocabulary, from the served tokenizer."""
    from services.worker.engine.sim.sim_model import load_vocab

    return load_vocab(model_dir)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of this test's own, on a free port."""
    from shared.redis_io.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    """A Redis Cluster of this test's own: 3 masters with a replica each (tests/support/redis_cluster.py; ~2 s to
    create). Skipped, saying why, where no redis-server or redis-cli can be found."""
    from shared.wire.errors import FatalError
    from tests.support.redis_cluster import LocalRedisCluster

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

    from shared.wire.constants import Names

    return Names(f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The served model as transformers runs it, float32, one instance for every reference of the session (each is
    540 MB): read only, never given to an engine (the engine switches its model's attention: `engine_model`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_reference(model_dir: Path, request):
    """transformers' greedy continuation of a prompt, for token-for-token comparisons: computed on `hf_model` once
    per machine and kept on disk, shared by the test processes (tests/support/references.py); the model is loaded
    only for a continuation the file does not hold."""
    from tests.support.references import GreedyReferences

    return GreedyReferences(model_dir, lambda: request.getfixturevalue("hf_model"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, model_dir):
    """One worker and one of each other service, shared by the end-to-end tests that harm nothing.
    Tests that kill or stop processes start a cluster of their own (`start_cluster`)."""
    from tests.support.cluster import Cluster, running

    if os.environ.get("CONVEYOR_TEST_REDIS_CLUSTER") == "1":  # the same tests on a Redis Cluster (issue 16)
        from tests.support.redis_cluster import LocalRedisCluster

        with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as rc:
            with running(
                Cluster(tmp_path_factory.mktemp("cluster"), CACHE_DIR, redis_url=rc.url, redis_cluster=True)
            ) as c:
                yield c
        return
    with running(Cluster(tmp_path_factory.mktemp("cluster"), CACHE_DIR)) as c:
        yield c


@pytest.fixture(scope="session")
def keyed_cluster(tmp_path_factory, model_dir):
    """Simulated workers behind API keys: KEY_A and KEY_B, and ADMIN an admin key (tests/support/cluster.py), with a
    trace URL template. Shared by the tests of keys, priorities and the dashboard's data: each reads or cancels
    only requests of its own."""
    from tests.support.cluster import ADMIN, KEY_A, KEY_B, Cluster, running
    from tests.support.sim_reference import SIM

    env = {
        **SIM,
        "CONVEYOR_API_KEYS": f"{KEY_A},{KEY_B}",
        "CONVEYOR_ADMIN_API_KEYS": ADMIN,
        "CONVEYOR_TRACE_URL_TEMPLATE": "http://jaeger.example:16686/trace/{trace_id}",
    }
    # Cluster's wait for /ready sends no key, as a probe: that it gets ready is part of what the keyed tests prove.
    with running(Cluster(tmp_path_factory.mktemp("keyed"), CACHE_DIR, env=env)) as c:
        yield c


@pytest.fixture(scope="session")
def sim_cluster(tmp_path_factory, model_dir):
    """One simulated worker with the default settings, and one of each other service, no API keys: shared by the
    control-plane tests that harm nothing and do not need the model's numbers."""
    from tests.support.cluster import Cluster, running
    from tests.support.sim_reference import SIM

    with running(Cluster(tmp_path_factory.mktemp("sim-cluster"), CACHE_DIR, env=SIM)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    """The official OpenAI client pointed at the module's `cluster` (the shared one unless the module has its own)."""
    from tests.support.openai_fixtures import openai_client

    return openai_client(cluster.url)


@pytest.fixture
def start_cluster(tmp_path, model_dir):
    """start_cluster(**Cluster's keywords) -> a started cluster of this test's own, stopped after the test whatever
    happened (also one that failed to start). For tests that kill, stop or reconfigure processes."""
    from tests.support.cluster import Cluster

    started: list = []

    def start(cls=Cluster, **kw):
        c = cls(tmp_path / f"cluster{len(started)}", CACHE_DIR, **kw)
        started.append(c)
        return c.start()

    yield start
    for c in reversed(started):
        c.stop()


# The engine's own tests (tests/e2e/engine): one model for the engine.


@pytest.fixture(scope="session")
def chat(tokenizer):
    """question (and system, history) -> the chat template's prompt ids."""

    def encode(question: str, system: str | None = None, history: list[dict] | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + (history or [])
        messages.append({"role": "user", "content": question})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    return encode


@pytest.fixture(scope="session")
def engine_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    # Every object alive now (the collected tests, torch, transformers, this model) is moved out of the collector's
    # sight: the full collections make_engine runs around each engine then scan only what came after (0.2-0.3 s
    # each over ~400,000 objects, 18 % of the engine tests' time before). No engine exists yet to be frozen alive.
    gc.collect()
    gc.freeze()
    return model


@pytest.fixture
def make_engine(engine_model):
    from services.worker.engine import EngineConfig, LLMEngine
    from shared.settings import WorkerSettings

    # CONVEYOR_CPU_ISA=avx2 (say) runs the engine tests on that build of the CPU kernels
    isa = WorkerSettings().cpu_isa

    def build(**overrides) -> LLMEngine:
        # No GEMM measuring: its plans are tested in test_engine_gemm (every kernel equals nn.Linear, plans kept on
        # disk); measured here (in memory, this process's one thread) it cost 70-115 s at the engine tests' start.
        # The unmeasured plan runs the model's codes at decode (gemm.unmeasured_plans), as a served worker's does.
        cfg = {"num_kv_blocks": 256, "max_num_batched_tokens": 512, "max_num_seqs": 64, "cpu_isa": isa}
        # Nor huge pages (tests/unit/test_huge_pages.py covers them): moving the process's memory into them took
        # 62 s of the engine tests' 244 s (88 engines, up to 8 s each on a VM with free page reporting, 2026-12-05).
        cfg = cfg | {"gemm_tuning": False, "huge_pages": False} | overrides
        return LLMEngine.from_model(engine_model, EngineConfig(**cfg))

    # An engine is freed by the cyclic garbage collector only (its parts refer to one another), which counts objects,
    # not bytes: each engine's KV pool and fused weights (300 MB) piled up until the engine tests' process held 9 GB.
    # They are collected before each engine is built and after each test.
    def fresh(**overrides) -> LLMEngine:
        gc.collect()
        return build(**overrides)

    yield fresh
    gc.collect()
