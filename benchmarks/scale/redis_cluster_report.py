"""The Redis Cluster benchmark's summary (benchmarks/scale/redis_cluster.py): per setup and level the runs' means, cluster
against single Redis, what one shard carries, and the markdown tables docs/benchmarks.md takes.
"""

from __future__ import annotations

SERVICES = ["gateway", "tokenizer", "scheduler", "worker"]
# The figures a setup's runs at one level are averaged over
MEANS = (
    "tokens_per_s",
    "ttft_added_p50",
    "ttft_added_p99",
    "tpot_added_p50",
    "tpot_added_p99",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "tpot_p99",
    "redis_commands_per_token",
)
# The figures of a level whose ratio cluster / single Redis is reported
RATIOS = (
    "tokens_per_s",
    "redis_commands_per_token",
    "ttft_added_p50",
    "ttft_added_p99",
    "tpot_added_p50",
    "tpot_added_p99",
)
NODE_FIGURES = ("commands_per_token", "share", "cpu_s_per_1k_tokens", "cpu_core_share")


def avg(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(runs: list[dict], levels: list[int], cores: float) -> dict:
    """Per setup and level, the runs' mean (and each run's tokens/s); per level, cluster / single ratios; and what
    one shard carries at `cores` of one core."""
    out: dict = {}
    for kind in ("single", "cluster"):
        for level in levels:
            ls = [lv for r in runs if r["kind"] == kind for lv in r["levels"] if lv["streams"] == level]
            if ls:
                out.setdefault(kind, {})[str(level)] = level_summary(runs, kind, ls)  # str: as JSON keys are
    for level in levels:
        single = out.get("single", {}).get(str(level))
        for kind in ("single", "cluster"):
            if (s := out.get(kind, {}).get(str(level))) is not None:
                s["capacity"] = capacity(s, single, cores)
    out["ratio_cluster_to_single"] = ratios(out, levels)
    return out


def node_mean(ls: list[dict], node: str, figure: str) -> float | None:
    """One Redis node's figure, averaged over the runs' levels ls."""
    return avg([lv["redis_nodes"][node][figure] for lv in ls])


def top_commands_per_token(ls: list[dict]) -> list[tuple[str, float]]:
    """The 8 commands called most per token, the runs' levels ls averaged."""
    cmds: dict[str, float] = {}
    for lv in ls:
        tokens = max(1, lv["tokens"])
        for name, n in lv["redis_top_commands"]:
            cmds[name] = cmds.get(name, 0.0) + n / tokens / len(ls)
    return sorted(cmds.items(), key=lambda kv: -kv[1])[:8]


def level_summary(runs: list[dict], kind: str, ls: list[dict]) -> dict:
    """One setup at one level: its runs' levels ls pooled (sums) and averaged (the rest)."""
    masters = [k for k, n in ls[0]["redis_nodes"].items() if n["role"] == "master"]
    replicas = [k for k, n in ls[0]["redis_nodes"].items() if n["role"] != "master"]
    s = {
        "runs": len(ls),
        "requests": sum(lv["requests"] for lv in ls),
        "ok": sum(lv["ok"] for lv in ls),
        "failed": sum(lv["failed"] for lv in ls),
        "tokens_per_s_each": [lv["tokens_per_s"] for lv in ls],
        **{k: avg([lv[k] for lv in ls]) for k in MEANS},
        "cpu_s_per_1k_tokens": {k: avg([lv["cpu_s_per_1k_tokens"].get(k) for lv in ls]) for k in SERVICES + ["client"]},
        "redis_top_commands_per_token": top_commands_per_token(ls),
        "masters": masters,
        "replicas": replicas,
        "nodes": {
            k: {f: node_mean(ls, k, f) for f in NODE_FIGURES} | {"role": ls[0]["redis_nodes"][k]["role"]}
            for k in masters + replicas
        },
        "redis_cpu_s_per_1k_tokens_masters": sum(node_mean(ls, k, "cpu_s_per_1k_tokens") for k in masters),
        "redis_cpu_s_per_1k_tokens_replicas": sum(node_mean(ls, k, "cpu_s_per_1k_tokens") for k in replicas),
    }
    add_cores(s, [r["idle_window"]["cpu_core_share"] for r in runs if r["kind"] == kind], ls)
    return s


def add_cores(s: dict, idle: list[dict], ls: list[dict]) -> None:
    """Into a level's summary s: the services' cores used during the level, and per request beyond the idle polling
    (idle: each run's idle window's cores); Redis's CPU per command and cores."""
    nodes = s["masters"] + s["replicas"]
    s["requests_per_s"] = avg([lv["ok"] / lv["duration_s"] for lv in ls])
    s["service_cores"] = {k: avg([lv["cpu_s"].get(k, 0.0) / lv["duration_s"] for lv in ls]) for k in SERVICES}
    s["service_idle_cores"] = {k: avg([i.get(k, 0.0) for i in idle]) for k in SERVICES}
    s["service_ms_per_request"] = {
        k: (s["service_cores"][k] - s["service_idle_cores"][k]) / s["requests_per_s"] * 1000 for k in SERVICES
    }
    s["redis_us_per_command"] = {
        k: node_mean(ls, k, "cpu_s_per_1k_tokens") / node_mean(ls, k, "commands_per_token") * 1000 for k in nodes
    }
    s["redis_cores"] = sum(node_mean(ls, k, "cpu_core_share") for k in nodes)


def capacity(s: dict, single: dict | None, cores: float) -> dict:
    """What one shard carries at `cores` of a core, two ways. (a) measured: the masters' Redis CPU per token as
    measured here; one shard takes 1/masters of it (the busiest more: the whole cluster stops when it is full).
    (b) the cluster's commands per token priced at the single Redis's CPU per command at the same level (single:
    its summary there): a Redis at 6-10 % of a core spends about twice the CPU per command of one at 25 % (fewer
    commands per event-loop wake-up), so (a) understates what a busy shard carries."""
    m_, busiest = s["masters"], max(s["masters"], key=lambda k: s["nodes"][k]["cpu_s_per_1k_tokens"])
    busiest_c = max(m_, key=lambda k: s["nodes"][k]["commands_per_token"])
    cap = {
        "cores": cores,
        "busiest_master": busiest,
        "measured_tokens_per_s_per_shard": cores / (s["redis_cpu_s_per_1k_tokens_masters"] / 1000 / len(m_)),
        "measured_tokens_per_s_whole": cores / (s["nodes"][busiest]["cpu_s_per_1k_tokens"] / 1000),
    }
    if single:
        us = single["redis_us_per_command"][single["masters"][0]] / 1e6
        cap.update(
            us_per_command=us * 1e6,
            priced_tokens_per_s_per_shard=cores / (us * s["redis_commands_per_token"] / len(m_)),
            priced_tokens_per_s_whole=cores / (us * s["nodes"][busiest_c]["commands_per_token"]),
        )
    return cap


def ratios(out: dict, levels: list[int]) -> dict:
    """Per level where both setups ran: cluster / single of RATIOS and of the masters' Redis CPU per token."""
    found = {}
    for level in levels:
        a, b = out.get("single", {}).get(str(level)), out.get("cluster", {}).get(str(level))
        if a and b:
            found[str(level)] = {k: (b[k] / a[k] if a[k] and b[k] is not None else None) for k in RATIOS}
            found[str(level)]["redis_cpu_s_per_1k_tokens_masters"] = (
                b["redis_cpu_s_per_1k_tokens_masters"] / a["redis_cpu_s_per_1k_tokens_masters"]
            )
    return found


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}" if v * 1000 >= 100 else f"{v * 1000:.1f}"


def num(v: float | None, d: int = 2) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def capacity_cell(x: dict, k: str) -> str:
    return "-" if k not in x["capacity"] else f"{x['capacity'][k]:,.0f}"


def markdown(data: dict) -> str:
    """The tables of docs/benchmarks.md's section from a result."""
    s, levels = data["summary"], data["args"]["levels"]
    cols = [(k, str(lv)) for lv in levels for k in ("single", "cluster", "ratio")]
    head = (
        "| | "
        + " | ".join(
            ("1 Redis" if k == "single" else "cluster" if k == "cluster" else "cluster / 1") + f", {int(lv):,}"
            for k, lv in cols
        )
        + " |"
    )
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    lines += [table_row(s, cols, *row) for row in traffic_rows() + redis_rows() + cost_rows()]
    return "\n".join(
        lines + ["", idle_table(data), "", node_table(data, str(levels[-1])), "", command_diff_table(data, levels)]
    )


def table_row(s: dict, cols: list[tuple[str, str]], name: str, f, ratio: str | None = None) -> str:
    """One row of markdown's table: f of each setup's summary at each level, and the ratio's key's value."""
    cells = []
    for k, lv in cols:
        if k == "ratio":
            r = s["ratio_cluster_to_single"].get(lv, {}).get(ratio) if ratio else None
            cells.append("-" if r is None else f"{r:.2f}")
        else:
            x = s.get(k, {}).get(lv)
            cells.append(f(x) if x else "-")
    return f"| {name} | " + " | ".join(cells) + " |"


def traffic_rows() -> list[tuple]:
    """markdown's rows of what was delivered and how fast: (name, the cell from a setup's summary at a level[, the
    key of its ratio])."""
    return [
        ("streams ok / failed", lambda x: f"{x['ok']:,} / {x['failed']:,}"),
        ("tokens/s delivered (mean)", lambda x: f"{x['tokens_per_s']:,.0f}", "tokens_per_s"),
        ("tokens/s, each run", lambda x: ", ".join(f"{v:,.0f}" for v in x["tokens_per_s_each"])),
        (
            "TTFT added p50 / p99 ms",
            lambda x: f"{ms(x['ttft_added_p50'])} / {ms(x['ttft_added_p99'])}",
            "ttft_added_p50",
        ),
        (
            "TPOT added p50 / p99 ms",
            lambda x: f"{ms(x['tpot_added_p50'])} / {ms(x['tpot_added_p99'])}",
            "tpot_added_p50",
        ),
    ]


def redis_rows() -> list[tuple]:
    """markdown's rows of the Redis commands and CPU it took, in all and per node (as traffic_rows)."""
    return [
        ("Redis commands / token (masters)", lambda x: num(x["redis_commands_per_token"]), "redis_commands_per_token"),
        (
            "... per master (share)",
            lambda x: ", ".join(
                f"{k} {num(x['nodes'][k]['commands_per_token'])} ({x['nodes'][k]['share']:.0%})" for k in x["masters"]
            ),
        ),
        (
            "Redis CPU s / 1k tokens, masters",
            lambda x: num(x["redis_cpu_s_per_1k_tokens_masters"], 3),
            "redis_cpu_s_per_1k_tokens_masters",
        ),
        (
            "... per master",
            lambda x: ", ".join(f"{k} {num(x['nodes'][k]['cpu_s_per_1k_tokens'], 3)}" for k in x["masters"]),
        ),
        (
            "... replicas (sum; per replica)",
            lambda x: (
                "-"
                if not x["replicas"]
                else f"{num(x['redis_cpu_s_per_1k_tokens_replicas'], 3)}; "
                + ", ".join(f"{k} {num(x['nodes'][k]['cpu_s_per_1k_tokens'], 3)}" for k in x["replicas"])
            ),
        ),
        (
            "busiest Redis node, share of a core",
            lambda x: next(
                f"{x['nodes'][k]['cpu_core_share']:.0%} ({k})"
                for k in sorted(x["masters"], key=lambda k: -x["nodes"][k]["cpu_core_share"])
            ),
        ),
        (
            "Redis CPU µs / command, masters",
            lambda x: ", ".join(f"{k} {x['redis_us_per_command'][k]:.1f}" for k in x["masters"]),
        ),
    ]


def cost_rows() -> list[tuple]:
    """markdown's rows of the cores used, the services' CPU, and what one shard carries (as traffic_rows)."""
    return [
        (
            "cores used: services + client + Redis",
            lambda x: (
                f"{sum(x['service_cores'].values()):.2f} + "
                f"{x['cpu_s_per_1k_tokens']['client'] * x['tokens_per_s'] / 1000:.2f} + {x['redis_cores']:.2f}"
            ),
        ),
        *[(f"CPU s / 1k tokens: {svc}", lambda x, svc=svc: num(x["cpu_s_per_1k_tokens"][svc], 3)) for svc in SERVICES],
        ("top commands / token", lambda x: ", ".join(f"{k} {v:.2f}" for k, v in x["redis_top_commands_per_token"][:6])),
        *[
            (f"{svc} CPU ms / request (above idle)", lambda x, svc=svc: num(x["service_ms_per_request"][svc]))
            for svc in ("tokenizer", "scheduler")
        ],
        (
            "tokens/s a shard carries at 80 % of a core: measured CPU / token",
            lambda x: capacity_cell(x, "measured_tokens_per_s_per_shard"),
        ),
        (
            "... whole Redis, until its busiest master is there",
            lambda x: capacity_cell(x, "measured_tokens_per_s_whole"),
        ),
        (
            "tokens/s a shard carries: commands / token at 1 Redis's µs / command",
            lambda x: capacity_cell(x, "priced_tokens_per_s_per_shard"),
        ),
        ("... whole Redis, until its busiest master is there", lambda x: capacity_cell(x, "priced_tokens_per_s_whole")),
    ]


def masters_commands_per_token(data: dict, kind: str, level: str) -> dict[str, float]:
    """Every command's calls per token on the masters, the runs of a setup at a level pooled."""
    ls = [lv for r in data["runs"] if r["kind"] == kind for lv in r["levels"] if str(lv["streams"]) == level]
    out: dict[str, float] = {}
    for lv in ls:
        for n in lv["redis_nodes"].values():
            if n["role"] == "master":
                for name, calls in n["top_commands"]:
                    out[name] = out.get(name, 0.0) + calls / max(1, lv["tokens"]) / len(ls)
    return out


def command_diff_table(data: dict, levels: list, top: int = 14) -> str:
    """Commands per token on the masters, 1 Redis and cluster, the largest differences first: where the cluster's
    extra commands come from."""
    per = {(k, str(lv)): masters_commands_per_token(data, k, str(lv)) for k in ("single", "cluster") for lv in levels}
    last = str(levels[-1])
    names = sorted(
        {c for d in per.values() for c in d},  # ties by name: a set's order changes from run to run
        key=lambda c: (-abs(per[("cluster", last)].get(c, 0) - per[("single", last)].get(c, 0)), c),
    )
    head = (
        "| command / token (masters) | "
        + " | ".join(f"1 Redis, {int(lv):,} | cluster, {int(lv):,}" for lv in levels)
        + " |"
    )
    lines = [head, "|---" * (1 + 2 * len(levels)) + "|"]
    for c in names[:top]:
        lines.append(
            f"| {c} | "
            + " | ".join(
                f"{per[('single', str(lv))].get(c, 0):.2f} | {per[('cluster', str(lv))].get(c, 0):.2f}" for lv in levels
            )
            + " |"
        )
    lines.append(
        "| all | "
        + " | ".join(
            f"{sum(per[('single', str(lv))].values()):.2f} | {sum(per[('cluster', str(lv))].values()):.2f}"
            for lv in levels
        )
        + " |"
    )
    return "\n".join(lines)


def idle_table(data: dict) -> str:
    """Each run's idle window: Redis commands/s (and the top ones), Redis and services' CPU, no request."""
    lines = [
        "| idle, no request | Redis commands/s | top commands/s | Redis CPU, share of a core (all nodes) | "
        "tokenizer / scheduler / workers / gateway CPU |",
        "|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        w = r["idle_window"]
        cpu = w["cpu_core_share"]
        lines.append(
            f"| run {r['run']}, {'1 Redis' if r['kind'] == 'single' else 'cluster'} | "
            f"{w['redis_commands_per_s']:,.0f} | "
            + ", ".join(f"{k} {v:,.0f}" for k, v in w["redis_top_commands_per_s"][:5])
            + " | "
            + f"{sum(w['redis_cpu_core_share'].values()):.1%} | "
            + " / ".join(f"{cpu.get(k, 0):.1%}" for k in ("tokenizer", "scheduler", "worker", "gateway"))
            + " |"
        )
    return "\n".join(lines)


def node_table(data: dict, level: str) -> str:
    """Per Redis node at one level (the runs of a setup pooled): commands per token, the top ones, CPU."""
    lines = [
        f"| {int(level):,} streams | commands / token | top commands / token | CPU s / 1k tokens |",
        "|---|---|---|---|",
    ]
    for kind in ("single", "cluster"):
        ls = [lv for r in data["runs"] if r["kind"] == kind for lv in r["levels"] if str(lv["streams"]) == level]
        if not ls:
            continue
        for label in ls[0]["redis_nodes"]:
            per: dict[str, float] = {}
            for lv in ls:
                for name, n in lv["redis_nodes"][label]["top_commands"]:
                    per[name] = per.get(name, 0.0) + n / max(1, lv["tokens"]) / len(ls)
            n = [lv["redis_nodes"][label] for lv in ls]
            lines.append(
                f"| {'1 Redis' if kind == 'single' else 'cluster ' + label} ({n[0]['role']}) | "
                f"{avg([x['commands_per_token'] for x in n]):.2f} | "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:6])
                + f" | {avg([x['cpu_s_per_1k_tokens'] for x in n]):.3f} |"
            )
    return "\n".join(lines)


def print_summary(data: dict) -> None:
    print("\n" + markdown(data))
    for r in data["runs"]:
        print(
            f"\nrun {r['run']} {r['kind']}: idle {r['idle_window']['redis_commands_per_s']:.0f} commands/s, "
            f"server log {r['server_log']['lines']} warnings/errors {r['server_log']['top'][:3]}"
        )
        if r["kind"] == "cluster":
            print(f"  failover: {r['failover']}, node log: {r['node_log'] or 'quiet'}")
            for label, lay in r["layout"].items():
                print(
                    f"  {label}: partitions {lay['partitions']}, worker inboxes {lay['worker_inboxes']}, "
                    f"gateway reply streams {lay['gateway_reply_streams']}, {lay['shared']}"
                )
