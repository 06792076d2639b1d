"""The multi-turn benchmark's report (benchmarks/peer/multiturn.py): AIPerf's per-request records reduced to TTFT by turn
index, each server's throughput and counters, Conveyor against vLLM, and the plot of TTFT by turn.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.common import mean, percentile, print_table


def metric(rec: dict, key: str):
    v = rec.get("metrics", {}).get(key)
    return v.get("value") if isinstance(v, dict) else v


def load_records(path: Path) -> list[dict]:
    """AIPerf's per-request records, reduced to what is reported here."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        md = r.get("metadata", {})
        headers = (r.get("trace_data") or {}).get("request_headers") or {}
        err = r.get("error") or {}
        out.append(
            {
                "conversation": md.get("conversation_id"),
                "turn": md.get("turn_index"),
                "correlation_id": md.get("x_correlation_id"),
                "start_ns": md.get("request_start_ns"),
                "end_ns": md.get("request_end_ns"),
                "error": (err.get("message") or err.get("type") or "error") if err else None,
                "ttft_ms": metric(r, "time_to_first_token"),
                "prompt_tokens": metric(r, "usage_prompt_tokens"),
                "cached_tokens": metric(r, "usage_prompt_cache_read_tokens"),
                "output_tokens": metric(r, "usage_completion_tokens") or metric(r, "output_sequence_length"),
                "headers": sorted(k for k in headers if k.lower() not in ("host", "content-length")),
            }
        )
    return out


def turn_summary(t: int, rs: list[dict]) -> dict:
    """TTFT and prompt, cached and computed prefill tokens of the answered requests rs of turn index t."""
    ttft = [r["ttft_ms"] for r in rs]
    prompt = [r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None]
    cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
    computed = [r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in rs if r["prompt_tokens"] is not None]
    return {
        "turn": t + 1,  # 1-based, as the issue counts them
        "n": len(rs),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": mean(ttft),
        "prompt_tokens_mean": mean(prompt),
        "cached_tokens_mean": mean(cached) if cached else None,
        "prefill_computed_mean": mean(computed),
        "prefill_computed_sum": sum(computed),
    }


def summarize(recs: list[dict]) -> dict:
    ok = [r for r in recs if not r["error"] and r["ttft_ms"] is not None]
    by_turn: dict[int, list[dict]] = defaultdict(list)
    for r in ok:
        by_turn[r["turn"]].append(r)
    turns = [turn_summary(t, by_turn[t]) for t in sorted(by_turn)]
    starts = [r["start_ns"] for r in recs if r["start_ns"] is not None]
    ends = [r["end_ns"] for r in recs if r["end_ns"] is not None]
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else None
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    per_conv: dict[str, set] = defaultdict(set)
    for r in recs:
        per_conv[r["conversation"]].add(r["correlation_id"])
    header_sets = sorted({tuple(r["headers"]) for r in recs})
    return {
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "errors": sorted({str(r["error"])[:200] for r in recs if r["error"]})[:10],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else None,
        "total_tok_s": (out_tokens + prompt_tokens) / duration if duration else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "prefill_computed": prompt_tokens - cached,
        # one id per conversation, a different one for each: what the session header carries
        "conversation_ids_stable": all(len(ids) == 1 for ids in per_conv.values())
        and len({next(iter(ids)) for ids in per_conv.values()}) == len(per_conv),
        "headers_sent": [list(h) for h in header_sets],
        "per_turn": turns,
    }


# ---- report ----


def ratio(a, b):
    return a / b if a is not None and b else None


# The totals of each server the report's second table lists
TOTALS = [
    "requests",
    "failed",
    "duration_s",
    "output_tok_s",
    "total_tok_s",
    "prompt_tokens",
    "prefill_computed",
    "client_cpu_s",
    "server_cpu_s",
    "loadavg_1m",
    "kv_capacity_tokens",
]


def report(results: dict[str, dict]) -> dict:
    names = list(results)
    per_turn = {n: {t["turn"]: t for t in results[n].get("per_turn", [])} for n in names}
    all_turns = sorted({t for n in names for t in per_turn[n]})
    both = "conveyor" in results and "vllm" in results
    print("\nTTFT by turn (ms; prefill tok: mean prompt tokens not served from a cache)")
    print_table(*turn_table(names, per_turn, all_turns, both))
    print()
    print_table(["", *names], [[k, *[results[n].get(k) for n in names]] for k in TOTALS])
    verdict = goals(results, per_turn, all_turns, both)
    for k, v in verdict.items():
        print(f"{k}: {json.dumps(v, default=lambda x: round(x, 3)) if not isinstance(v, float) else round(v, 3)}")
    return verdict


def turn_table(names: list[str], per_turn: dict, all_turns: list[int], both: bool) -> tuple[list, list]:
    """-> (headers, rows) of TTFT by turn: each server's p50, p99 and prefill tokens, with both Conveyor / vLLM."""
    headers = ["turn"]
    for n in names:
        headers += [f"{n} p50 ms", f"{n} p99 ms", f"{n} prefill tok"]
    if both:
        headers += ["p50 c/v", "p99 c/v"]
    rows = []
    for t in all_turns:
        row: list = [t]
        for n in names:
            x = per_turn[n].get(t, {})
            row += [x.get("ttft_p50_ms"), x.get("ttft_p99_ms"), x.get("prefill_computed_mean")]
        if both:
            c, v = per_turn["conveyor"].get(t, {}), per_turn["vllm"].get(t, {})
            row += [
                ratio(c.get("ttft_p50_ms"), v.get("ttft_p50_ms")),
                ratio(c.get("ttft_p99_ms"), v.get("ttft_p99_ms")),
            ]
        rows.append(row)
    return headers, rows


def goals(results: dict[str, dict], per_turn: dict, all_turns: list[int], both: bool) -> dict:
    """The verdict: each server's TTFT drift from its first turn to its last; with both, the issue's goals (TTFT from
    turn 5 on at most half of vLLM's, output throughput at least vLLM's)."""
    verdict: dict = {}
    for n in results:
        ts = per_turn[n]
        if ts:
            first, last = ts[min(ts)], ts[max(ts)]
            verdict[f"{n}_ttft_p50_last_over_first"] = ratio(last["ttft_p50_ms"], first["ttft_p50_ms"])
    if both:
        late = [t for t in all_turns if t >= 5 and t in per_turn["conveyor"] and t in per_turn["vllm"]]
        p50 = {t: ratio(per_turn["conveyor"][t]["ttft_p50_ms"], per_turn["vllm"][t]["ttft_p50_ms"]) for t in late}
        verdict["ttft_p50_ratio_from_turn5"] = p50
        verdict["ttft_p50_ratio_from_turn5_max"] = max((v for v in p50.values() if v is not None), default=None)
        verdict["output_tok_s_ratio"] = ratio(
            results["conveyor"].get("output_tok_s"), results["vllm"].get("output_tok_s")
        )
        worst = verdict["ttft_p50_ratio_from_turn5_max"]
        verdict["goal_ttft_half_from_turn5"] = None if worst is None else worst <= 0.5  # None: no turn 5
        verdict["goal_throughput"] = (verdict["output_tok_s_ratio"] or 0) >= 1.0
    return verdict


def plot(results: dict[str, dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"vllm": "tab:blue", "conveyor": "tab:orange"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, res in results.items():
        ts = res.get("per_turn", [])
        if not ts:
            continue
        x = [t["turn"] for t in ts]
        c = colors.get(n)
        ax.plot(x, [t["ttft_p50_ms"] for t in ts], "-o", color=c, label=f"{n} p50")
        ax.plot(x, [t["ttft_p99_ms"] for t in ts], "--^", color=c, label=f"{n} p99")
        bx.plot(x, [t["prefill_computed_mean"] for t in ts], "-o", color=c, label=f"{n} computed")
        bx.plot(x, [t["prompt_tokens_mean"] for t in ts], ":", color=c, label=f"{n} prompt")
    ax.set(xlabel="turn", ylabel="TTFT (ms)", title="TTFT by turn index")
    bx.set(xlabel="turn", ylabel="tokens per request (mean)", title="prompt tokens and prefill computed")
    turns = sorted({t["turn"] for res in results.values() for t in res.get("per_turn", [])})
    for a in (ax, bx):
        a.set_xticks(turns)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
        a.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
