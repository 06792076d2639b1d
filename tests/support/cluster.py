"""A whole local cluster for end-to-end tests: real redis-server, real service processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from shared.wire.constants import Names
from shared.process.ready import wait_ok
from shared.redis_io.redis_server import RedisServer, die_with_parent, free_port
from shared.settings import CommonSettings
from tests.support.cache import CACHE_DIR
from tests.support.xdist import sharing_the_cores

SERVICES = ("tokenizer", "scheduler", "worker", "gateway")


def _threads_beside_other_test_processes() -> dict[str, str]:
    """Under pytest-xdist (`make test`: four test processes on two cores) a cluster's services run torch on one
    thread, as the test processes themselves do (tests/conftest.py): several workers' two-thread OpenMP teams spin at
    their joins against each other's, and a test of six 24-token requests took 116 s in the suite against 9 s alone
    (2026-12-03, Intel Xeon VM). Alone (no xdist) they keep the machine's default."""
    return {"OMP_NUM_THREADS": "1"} if sharing_the_cores() else {}


class ExternalRedis:
    """A Redis the test started itself (a Redis Cluster: tests/support/redis_cluster.py): the cluster only points
    at it."""

    def __init__(self, url: str):
        self.url = url

    def start(self) -> "ExternalRedis":
        return self

    def stop(self) -> None:
        return None


class Cluster:
    def __init__(
        self,
        tmp: Path,
        cache_dir: Path,
        workers: int = 1,
        env: dict | None = None,
        redis_url: str | None = None,
        redis_cluster: bool = False,
        redis_appendonly: bool = False,
    ):
        self.tmp = Path(tmp)
        self.redis = (
            ExternalRedis(redis_url) if redis_url else RedisServer(self.tmp / "redis", appendonly=redis_appendonly)
        )
        self.port = free_port()
        self.ns = f"c{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "CONVEYOR_NAMESPACE": self.ns,
            "CONVEYOR_CACHE_DIR": str(cache_dir),
            "CONVEYOR_PORT": str(self.port),
            "CONVEYOR_KV_CACHE_BYTES": str(256 << 20),
            "CONVEYOR_CLAIM_IDLE_MS": "1000",
            "CONVEYOR_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            # A shared 2-core machine is slow and noisy: adaptive deadlines get a generous floor here;
            # the tests of deadlines set their own.
            "CONVEYOR_TIMEOUT_MIN_S": "120",
            "CONVEYOR_REDIS_CLUSTER": "true" if redis_cluster else "false",
            # No GEMM measuring at a worker's start (the unmeasured plan: the model's codes at up to 32 rows, F.linear
            # beyond): on a fresh 2-core machine the first worker measured for 180 s under the suite's load, and a
            # plan measured under load was measured again at a later start. The plans are tested in
            # tests/e2e/engine/test_engine_gemm.py.
            "CONVEYOR_GEMM_TUNING": "false",
            # Nor the warm-up over every shape bucket (~10 s of both cores per torch worker): only its smallest
            # prefill, the first forward's one-off costs (tests/e2e/engine/test_warmup.py covers the rest).
            "CONVEYOR_WARMUP_BUDGET_S": "0",
            # Nor huge pages (tests/unit/test_huge_pages.py): 11-26 s of a torch worker's start on a VM that hands
            # its free memory back to its host, for a speed no cluster test measures.
            "CONVEYOR_HUGE_PAGES": "false",
            **_threads_beside_other_test_processes(),
            **(env or {}),
        }
        self.workers = workers
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis_cluster = redis_cluster

    @property
    def names(self) -> Names:
        """The services' names (their partitions, on a Redis Cluster)."""
        return CommonSettings(namespace=self.ns, redis_cluster=self.redis_cluster).names()

    def client(self):
        """A client of the cluster's Redis for a test's own checks (redis-py's cluster client on a Redis Cluster)."""
        if self.redis_cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self.redis.url)
        return redis.Redis.from_url(self.redis.url)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 240.0) -> "Cluster":
        self.redis.start()
        self.env["CONVEYOR_REDIS_URL"] = self.redis.url
        for name in ("tokenizer", "scheduler", *[f"worker{i}" for i in range(self.workers)], "gateway"):
            self.start_service(name)
        self.wait_ready(ready_timeout)
        return self

    def start_service(self, name: str, extra_env: dict | None = None) -> subprocess.Popen:
        service = name.rstrip("0123456789")
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service],
            env={**self.env, **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.getcwd(),
            preexec_fn=die_with_parent,
        )
        self.procs[name] = proc
        return proc

    def wait_ready(self, timeout: float) -> None:
        def check() -> None:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs(name)}")

        if not wait_ok(f"{self.url}/ready", timeout, 0.3, check):
            raise RuntimeError("cluster not ready:\n" + "\n".join(self.logs(n) for n in self.procs))

    def logs(self, name: str, tail: int = 4000) -> str:
        path = self.tmp / f"{name}.log"
        return f"--- {name}\n" + (path.read_text(errors="replace")[-tail:] if path.exists() else "")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.redis.stop()


@contextlib.contextmanager
def running(cluster: "Cluster"):
    """A fixture's cluster: started, yielded, stopped whatever the tests did (`with running(Cluster(...)) as c`)."""
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def cluster_fixture(name: str, cls: type = None, scope: str = "module", **kw):
    """A fixture of a cluster started once for a module's tests (Cluster's keywords: env, workers, ...) and stopped
    after them: `slow = cluster_fixture("slow", env={...})` at a test module's top level."""

    @pytest.fixture(scope=scope)
    def fixture(tmp_path_factory, model_dir):
        with running((cls or Cluster)(tmp_path_factory.mktemp(name), CACHE_DIR, **kw)) as c:
            yield c

    return fixture


# API keys of the clusters that want one (env CONVEYOR_API_KEYS): tests of keys, the dashboard and priorities.
KEY_A, KEY_B = "key-alpha-0123456789", "key-beta-9876543210"
ADMIN = "key-admin-5555555555"  # an admin key (CONVEYOR_ADMIN_API_KEYS)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}
