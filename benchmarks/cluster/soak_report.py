"""The soak benchmark's figures (benchmarks/cluster/soak.py): each metric's series over the samples, its value after warm-up,
at the end of the load and after idling, its slope; the table printed and the PNG.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from benchmarks.common import print_table

MIB = 1 << 20


def series(samples: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    out: dict[str, list] = {}
    for s in samples:
        values = {f"redis {k}": v for k, v in s.get("redis", {}).items()}
        values.update({f"rss {k}": v for k, v in s["rss"].items()})
        values.update({f"latency {k}": v for k, v in s.get("latency", {}).items() if k != "n"})
        for name, v in values.items():
            out.setdefault(name, []).append((s["t_s"], v, s["phase"]))
    return out


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    n = len(points)
    mt, mv = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var * 60 if var else None


def analyse(samples: list[dict], args) -> dict:
    warm_t = args.warmup * args.duration
    out = {}
    for name, pts in series(samples).items():
        load = [(t, v) for t, v, ph in pts if ph in ("load", "end") and t >= warm_t]
        idle = [v for _, v, ph in pts if ph == "idle-end"]
        if not load:
            continue
        out[name] = {
            "after_warmup": load[0][1],
            "end": load[-1][1],
            "slope_per_min": slope_per_min(load),
            "change_pct": (load[-1][1] - load[0][1]) / load[0][1] * 100 if load[0][1] else None,
            "after_idle": idle[-1] if idle else None,
        }
    return out


def report(stats: dict, outcomes: Counter) -> None:
    rows = []
    for name, s in stats.items():
        k, unit = (1, "keys") if name.endswith("keys") else (1, "s") if name.startswith("latency") else (MIB, "MiB")
        rows.append(
            [
                f"{name} ({unit})",
                s["after_warmup"] / k,
                s["end"] / k,
                s["change_pct"],
                (s["slope_per_min"] or 0) / k,
                None if s["after_idle"] is None else s["after_idle"] / k,
            ]
        )
    print_table(["metric", "after warm-up", "end of load", "change %", "slope /min", "after idle"], rows)
    print(f"requests: {sum(outcomes.values())}")
    for key, n in sorted(outcomes.items()):
        print(f"  {n:7d}  {key}")


def minutes(pts: list[tuple[float, float, str]], unit: float) -> tuple[list[float], list[float]]:
    return [t / 60 for t, _, _ in pts], [v / unit for _, v, _ in pts]


def plot(samples: list[dict], args, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG")
        return None
    s = series(samples)
    fig, (top, bottom, lat) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    top.plot(*minutes(s.get("redis used_memory", []), MIB), marker=".")
    top.set_ylabel("Redis used_memory (MiB)")
    warm_min = args.warmup * args.duration / 60
    for name in sorted(n for n in s if n.startswith("rss ") and n != "rss redis"):  # each from the end of warm-up
        t, v = minutes(s[name], MIB)
        base = next((x for m, x in zip(t, v) if m >= warm_min), v[-1])
        bottom.plot(t, [x - base for x in v], label=name.removeprefix("rss "), lw=1)
    bottom.set_ylabel("RSS change after warm-up (MiB)")
    bottom.legend(fontsize=7, ncol=3)
    lat.plot(*minutes(s.get("latency p99_s", []), 1), marker=".")
    lat.set_ylabel("request latency p99 (s), per interval")
    for ax in (top, bottom, lat):
        ax.axvline(warm_min, color="grey", ls="--", lw=0.8)  # end of warm-up
        ax.axvline(args.duration / 60, color="grey", ls=":", lw=0.8)  # end of load
        ax.grid(alpha=0.3)
    keys = s.get("redis keys", [])
    twin = top.twinx()
    twin.plot([t / 60 for t, _, _ in keys], [v for _, v, _ in keys], color="tab:orange", lw=0.8)
    twin.set_ylabel("Redis keys (DBSIZE)", color="tab:orange")
    lat.set_xlabel("minutes (dashed: end of warm-up, dotted: end of load)")
    fig.suptitle(f"soak: {args.clients} clients, {args.duration:.0f} s, mix {args.mix}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
