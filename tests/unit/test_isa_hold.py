"""benchmarks.peer.isa_hold: both servers held to AVX2 on a wider CPU; vLLM's kernel-library choice through the shim."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.peer import isa_hold

ASK = "import torch.cpu; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"


def _ask_torch(env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("CONVEYOR_PEER_ISA", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", ASK], env={**base, **env}, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_shim_tells_a_process_started_with_the_avx2_environment_that_the_cpu_has_no_avx512():
    assert _ask_torch(isa_hold.vllm_env("avx2")) == "False False"


def test_the_shim_on_the_path_changes_nothing_without_the_variable_asking_for_it():
    with_shim = {"PYTHONPATH": str(isa_hold.SHIM)}
    assert _ask_torch(with_shim) == _ask_torch({})


def test_auto_holds_neither_server_and_avx2_holds_the_libraries_of_both():
    assert isa_hold.conveyor_env("auto") == {} and isa_hold.vllm_env("auto") == {}
    conveyor, vllm = isa_hold.conveyor_env("avx2"), isa_hold.vllm_env("avx2")
    assert conveyor["CONVEYOR_CPU_ISA"] == "avx2"
    for variable, value in isa_hold.LIBRARIES_AVX2.items():
        assert conveyor[variable] == vllm[variable] == value
