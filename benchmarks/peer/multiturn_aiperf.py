"""The multi-turn benchmark's client (benchmarks/peer/multiturn.py): NVIDIA AIPerf in a venv of its own, and the
`aiperf profile` command line of a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import MODEL_NAME

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = Path(os.environ.get("AIPERF_VENV", Path.home() / ".cache" / "conveyor-peers" / "aiperf"))
AIPERF = AIPERF_VENV / "bin" / "aiperf"


def aiperf_installed() -> bool:
    return AIPERF.exists()


def install_aiperf(venv: Path = AIPERF_VENV, version: str = AIPERF_VERSION) -> None:
    """AIPerf into a venv of its own (as benchmarks.peer.vllm_cpu installs vLLM): the benchmark client,
    never a dependency of Conveyor. Plain PyPI wheels; no GPU package is needed to drive an HTTP server."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={version}"], check=True)
    out = subprocess.run([str(venv / "bin" / "aiperf"), "--version"], capture_output=True, text=True, check=True)
    print(f"aiperf {out.stdout.strip()} installed in {venv}", flush=True)


def aiperf_cmd(url: str, model: Path, args, artifacts: Path) -> list[str]:
    return [
        str(AIPERF),
        "profile",
        "--model",
        MODEL_NAME,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(model),
        *workload_flags(args),
        "--artifact-dir",
        str(artifacts),
        *client_flags(args),
        *args.aiperf_args,
    ]


def workload_flags(args) -> list[str]:
    """The conversations AIPerf sends: how many, their turns, the think time between them, each turn's tokens."""
    think = args.think_ms if args.turns > 1 else 0
    return [
        "--conversation-num",
        str(args.conversations),
        "--conversation-turn-mean",
        str(args.turns),
        "--conversation-turn-stddev",
        "0",
        "--conversation-turn-delay-mean",
        str(think),
        "--conversation-turn-delay-stddev",
        str(args.think_stddev_ms if think else 0),
        "--isl",
        str(args.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.osl),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",
        "--concurrency",
        str(args.concurrency or args.conversations),
        "--random-seed",
        str(args.seed),
    ]


def client_flags(args) -> list[str]:
    """How AIPerf itself runs: its pacing, what it records, what it leaves out."""
    return [
        # AIPerf 0.13 in plain --concurrency mode spins its timing manager (~0.8 core here) while it waits for
        # the conversations' next turns; with a request rate far above the workload's it sleeps between ticks
        # instead (~0 core): turn starts are capped at 200/s, a turn may wait up to 5 ms for its tick.
        "--request-rate",
        "200",
        "--arrival-pattern",
        "constant",
        "--use-server-token-count",  # token counts from usage: no client-side tokenization of every prompt
        "--export-level",
        "records",
        "--export-http-trace",  # the request headers of every record: proof of what was sent
        "--ui-type",
        "none",
        "--no-server-metrics",  # scraped here, once before and once after
        "--no-gpu-telemetry",
        "--request-timeout-seconds",
        str(args.request_timeout),
    ]
