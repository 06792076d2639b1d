"""At DEBUG the worker logs one line a step (what a run's time went to, without a profiler); at INFO nothing. The
worker's real code (simulated engine) on a test's own Redis."""

from __future__ import annotations

import logging
import re

import pytest

from shared.wire.events import Sampling
from tests.support.scheduling import deliver, heartbeat, preprocessed_request, scheduler, sim_worker

STEP = re.compile(
    r"step \d+: [\d.]+ ms \(forward [\d.]+, with publish [\d.]+\), prefill (\d+) tokens, decode (\d+), running \d+, "
    r"waiting \d+; totals: swap-outs \d+, swap-ins \d+, preemptions \d+"
)


@pytest.fixture
def worker(redis_server, names, model_dir):
    w = sim_worker(redis_server, names)
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    deliver(s, names.preprocessed_stream(0), preprocessed_request(redis_server, names, sampling=Sampling(max_tokens=3)))
    s.place()
    return w


def _run(worker) -> None:
    worker.tick()
    while worker.engine.has_unfinished():
        worker.tick()


def test_each_step_is_one_debug_line_with_its_tokens(worker, caplog):
    caplog.set_level(logging.DEBUG, logger="services.worker.service")
    _run(worker)
    lines = [STEP.fullmatch(r.getMessage()) for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines and all(lines)
    assert int(lines[0].group(1)) > 0 and sum(int(m.group(2)) for m in lines) >= 2  # the prompt, then decodes


def test_no_step_line_at_info(worker, caplog):
    caplog.set_level(logging.INFO, logger="services.worker.service")
    _run(worker)
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]
