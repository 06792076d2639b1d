"""Fixtures of the engine's kernel tests."""

from __future__ import annotations

import shutil

import pytest

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.cpu.cpu_info import this_cpu
from shared.settings import CPU_ISAS


@pytest.fixture(scope="module", params=CPU_ISAS)
def kernels(request, kernels_dir):
    """torch.ops.conveyor_<isa> of one variant."""
    isa = request.param
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine (apt-get install g++): the engine uses gather + SDPA")
    lacking = cpu_ops.missing(isa)
    if lacking:
        pytest.skip(f"this CPU ({this_cpu().name}) lacks {','.join(sorted(lacking))}: the {isa} build cannot run here")
    ops = cpu_ops.build(isa, kernels_dir)
    if ops is None:
        pytest.fail(f"a C++ compiler is present but the {isa} CPU kernels did not build (see the warning above)")
    return ops
