"""The simulated engine builds and runs in a process of its own without importing torch or loading the weights (its
behaviour: tests/unit/test_sim_engine.py)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_building_the_sim_engine_loads_no_weights_and_imports_no_torch(model_dir):
    code = (
        "import sys; from services.worker.engine import EngineConfig; "
        "from services.worker.engine.sim.sim_model import SimTiming; "
        "from services.worker.engine.sim.sim_runner import build_sim_engine; "
        f"e = build_sim_engine({str(model_dir)!r}, EngineConfig(), SimTiming(0.01, 0.001, 0.001, 0.0)); "
        "assert e.stats().total_blocks > 0; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_constrained_sim_worker_imports_no_torch(model_dir):
    code = (
        "import sys, json; from services.worker.engine import EngineConfig, EngineRequest, SamplingOptions; "
        "from services.worker.engine.request import GrammarSpec; "
        "from services.worker.engine.sim.sim_model import SimTiming; "
        "from services.worker.engine.sim.sim_runner import build_sim_engine; "
        f"e = build_sim_engine({str(model_dir)!r}, EngineConfig(), SimTiming(0.0, 0.0, 0.0, 0.0)); "
        "e.add_request(EngineRequest('r', [5, 6, 7], SamplingOptions(max_tokens=4, grammar=GrammarSpec("
        "'json_schema', json.dumps({'type': 'object'}))))); "
        "[e.step() for _ in range(6)]; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
