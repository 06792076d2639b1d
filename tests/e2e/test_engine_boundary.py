"""The engine boundary: the worker's request types, outputs and engine protocols load without torch, so a
worker with the simulated engine (and anything else that only handles requests) never imports it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

MODULES = [
    "services.worker.engine.request",
    "services.worker.engine.outputs",
    "services.worker.engine.protocol",
    "services.worker.engine.kv.kv_tier",
    "services.worker.engine",
]


@pytest.mark.parametrize("module", MODULES)
def test_importing_the_worker_request_types_does_not_import_torch(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
