"""One PNG per metric of a benchmarks/scale/control_plane.py result (x: concurrent streams, log scale).
Run on a result file: .venv/bin/python -m benchmarks.scale.control_plane_plots RESULT.json [--before OLD.json] --out DIR
(--before draws a second run dashed, e.g. the code before a fix)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 1 << 20
SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "redis", "client")
LOG_Y = ("ttft-added", "health-latency")  # spanning orders of magnitude (always positive)


def _series(levels: list[dict]) -> dict[str, tuple[str, dict[str, list]]]:
    """metric file stem -> (y label, line label -> values per level)."""

    def ms(key: str) -> list:
        return [None if f.get(key) is None else f[key] * 1000 for f in levels]

    def per_service(key: str, scale: float = 1.0) -> dict:
        return {s: [f[key].get(s, 0) * scale for f in levels] for s in SERVICES}

    return {
        "ttft-added": ("TTFT added by the pipeline (ms)", {"p50": ms("ttft_added_p50"), "p99": ms("ttft_added_p99")}),
        "itl-added": ("ITL added by the pipeline (ms)", {"p50": ms("itl_added_p50"), "p99": ms("itl_added_p99")}),
        "tpot-added": ("TPOT added by the pipeline (ms)", {"p50": ms("tpot_added_p50"), "p99": ms("tpot_added_p99")}),
        "tokens-per-s": ("tokens/s delivered", {"tokens/s": [f["tokens_per_s"] for f in levels]}),
        "cpu-per-1k-tokens": ("CPU seconds per 1,000 tokens", per_service("cpu_s_per_1k_tokens")),
        "redis-commands-per-token": (
            "Redis commands per token",
            {"commands/token": [f["redis_commands_per_token"] for f in levels]},
        ),
        "redis-memory": (
            "Redis used_memory (MiB)",
            {
                "after the level": [f["redis_after"]["used_memory"] / MIB for f in levels],
                "peak in the level": [(f["peak"]["redis_used_memory"] or 0) / MIB for f in levels],
            },
        ),
        "rss": ("RSS after the level (MiB)", per_service("rss_after", 1 / MIB)),
        "health-latency": (
            "/health latency while streams are open (ms)",
            {
                "p50": [(f["health"]["p50"] or 0) * 1000 for f in levels],
                "p99": [(f["health"]["p99"] or 0) * 1000 for f in levels],
                "max": [(f["health"]["max"] or 0) * 1000 for f in levels],
            },
        ),
    }


def plot_all(data: dict, out: Path, prefix: str, before: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = _series(data["levels"])
    old = _series(before["levels"]) if before else {}
    paths = []
    for stem, (ylabel, lines) in now.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for i, (label, ys) in enumerate(lines.items()):
            color = f"C{i}"
            ax.plot(
                [f["streams"] for f in data["levels"]],
                ys,
                marker="o",
                color=color,
                label=label + (" (after)" if before else ""),
            )
            if stem in old and label in old[stem][1]:
                ax.plot(
                    [f["streams"] for f in before["levels"]],
                    old[stem][1][label],
                    marker="x",
                    ls="--",
                    color=color,
                    alpha=0.6,
                    label=f"{label} (before)",
                )
        ax.set_xscale("log")
        if stem in LOG_Y:
            ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.suptitle(f"control plane, 4 sim workers: {ylabel}", fontsize=9)
        fig.tight_layout()
        path = out / f"{prefix}-{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _named(service: str) -> str:
    return "worker (4, summed)" if service == "worker" else service


def _getter(key: str, service: str, show):
    return lambda f: show(f[key].get(service, 0))


def markdown_table(data: dict) -> str:
    """The per-level table of docs/benchmarks.md, from a result."""
    ms = lambda v: "-" if v is None else f"{v * 1000:,.0f}" if v >= 0.1 else f"{v * 1000:.1f}"  # noqa: E731
    mib = lambda v: f"{v / MIB:,.0f}"  # noqa: E731
    rows = [
        ("requests (ok / failed)", lambda f: f"{f['ok']:,} / {f['failed']}"),
        ("duration s", lambda f: f"{f['duration_s']:.1f}"),
        ("tokens/s delivered", lambda f: f"{f['tokens_per_s']:,.0f}"),
        ("TTFT p50 / p99 ms (client)", lambda f: f"{ms(f['ttft_p50'])} / {ms(f['ttft_p99'])}"),
        ("engine's own TTFT p50 / p99 ms", lambda f: f"{ms(f['engine']['ttft_p50'])} / {ms(f['engine']['ttft_p99'])}"),
        ("**TTFT added** p50 / p99 ms", lambda f: f"{ms(f['ttft_added_p50'])} / {ms(f['ttft_added_p99'])}"),
        ("ITL (between events) p50 / p99 ms", lambda f: f"{ms(f['itl_p50'])} / {ms(f['itl_p99'])}"),
        ("TPOT p50 / p99 ms (client)", lambda f: f"{ms(f.get('tpot_p50'))} / {ms(f.get('tpot_p99'))}"),
        ("engine's own ITL p50 / p99 ms", lambda f: f"{ms(f['engine']['itl_p50'])} / {ms(f['engine']['itl_p99'])}"),
        (
            "**ITL added** (TPOT − engine) p50 / p99 ms",
            lambda f: f"{ms(f.get('tpot_added_p50'))} / {ms(f.get('tpot_added_p99'))}",
        ),
        *[
            (f"CPU s / 1k tokens: {_named(s)}", _getter("cpu_s_per_1k_tokens", s, lambda v: f"{v:.3f}"))
            for s in SERVICES
        ],
        ("Redis commands / token", lambda f: f"{f['redis_commands_per_token']:.2f}"),
        (
            "Redis used_memory MiB (after / peak)",
            lambda f: f"{mib(f['redis_after']['used_memory'])} / {mib(f['peak']['redis_used_memory'] or 0)}",
        ),
        *[(f"RSS MiB after: {_named(s)}", _getter("rss_after", s, mib)) for s in SERVICES],
        (
            "/health p50 / p99 / max ms",
            lambda f: f"{ms(f['health']['p50'])} / {ms(f['health']['p99'])} / {ms(f['health']['max'])}",
        ),
    ]
    levels = data["levels"]
    out = ["| | " + " | ".join(f"{f['streams']:,} streams" for f in levels) + " |", "|---|" + "---|" * len(levels)]
    out += [f"| {name} | " + " | ".join(get(f) for f in levels) + " |" for name, get in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("result", type=Path)
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prefix", default="control-plane")
    ap.add_argument("--markdown", action="store_true", help="print the per-level table instead of plotting")
    args = ap.parse_args()
    if args.markdown:
        print(markdown_table(json.loads(args.result.read_text())))
        return
    before = json.loads(args.before.read_text()) if args.before else None
    for p in plot_all(json.loads(args.result.read_text()), args.out, args.prefix, before):
        print(p)


if __name__ == "__main__":
    main()
