"""benchmarks/peer/multiturn.py's reading of AIPerf's records, of /metrics and of the servers' logs (no server, no AIPerf)."""

import json

from benchmarks.peer.multiturn import kv_capacity_tokens, parse_counters
from benchmarks.peer.multiturn_report import load_records, report, summarize


def record(conv: int, turn: int, ttft: float, prompt: int, cached: int, error: dict | None = None) -> dict:
    start = 1_000_000_000 * (10 * conv + turn)
    return {
        "metadata": {
            "conversation_id": f"session_{conv:06d}",
            "turn_index": turn,
            "x_correlation_id": f"uuid-{conv}",
            "request_start_ns": start,
            "request_end_ns": start + 2_000_000_000,
        },
        "metrics": {
            "time_to_first_token": {"value": ttft, "unit": "ms"},
            "usage_prompt_tokens": {"value": prompt, "unit": "tokens"},
            "usage_prompt_cache_read_tokens": {"value": cached, "unit": "tokens"},
            "usage_completion_tokens": {"value": 64, "unit": "tokens"},
        },
        "trace_data": {
            "request_headers": {"Host": "h", "X-Correlation-ID": f"uuid-{conv}", "X-Session-ID": "<redacted>"}
        },
        **({"error": error} if error else {}),
    }


def write(tmp_path, recs):
    path = tmp_path / "profile_export.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_per_turn_ttft_and_prefill_computed(tmp_path):
    recs = [
        record(c, t, 100.0 * (t + 1) + c, 230 + 270 * t, 0 if t == 0 else 224 + 270 * (t - 1))
        for c in range(2)
        for t in range(3)
    ]
    s = summarize(load_records(write(tmp_path, recs)))
    assert [t["turn"] for t in s["per_turn"]] == [1, 2, 3]
    first, second = s["per_turn"][0], s["per_turn"][1]
    assert first["n"] == 2 and first["ttft_p50_ms"] == 100.5 and first["prefill_computed_mean"] == 230
    assert second["prompt_tokens_mean"] == 500 and second["prefill_computed_mean"] == 500 - 224
    assert s["requests"] == 6 and s["failed"] == 0 and s["output_tokens"] == 6 * 64
    assert s["duration_s"] == 14.0  # first send (conversation 0, turn 0) to last answer (conversation 1, turn 2)
    assert s["conversation_ids_stable"]
    assert s["headers_sent"] == [["X-Correlation-ID", "X-Session-ID"]]


def test_failed_requests_are_counted_not_measured(tmp_path):
    recs = [record(0, 0, 100.0, 230, 0), record(0, 1, 50.0, 500, 224, error={"code": 504, "message": "timeout"})]
    s = summarize(load_records(write(tmp_path, recs)))
    assert s["failed"] == 1 and s["errors"] == ["timeout"]
    assert [t["turn"] for t in s["per_turn"]] == [1]


def test_one_id_shared_by_two_conversations_is_not_stable(tmp_path):
    recs = [record(0, 0, 1.0, 10, 0), record(1, 0, 1.0, 10, 0)]
    for r in recs:
        r["metadata"]["x_correlation_id"] = "same"
    assert not summarize(load_records(write(tmp_path, recs)))["conversation_ids_stable"]


def test_counters_summed_over_labels_histogram_buckets_left_out():
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_total prompt tokens",
            'vllm:prompt_tokens_total{model_name="m"} 100.0',
            'vllm:prompt_tokens_total{model_name="n"} 20.0',
            'vllm:request_prompt_tokens_bucket{le="1.0"} 3.0',
            "conveyor:prefix_cache_hits_total 7",
            "conveyor:prefix_cache_hits_created 1.7e9",
            "conveyor:kv_cache_usage_perc 0.5",
            "conveyor:session_resumed_tokens_total 42",
        ]
    )
    assert parse_counters(text) == {
        "vllm:prompt_tokens_total": 120.0,
        "conveyor:prefix_cache_hits_total": 7.0,
        "conveyor:session_resumed_tokens_total": 42.0,
    }


def test_kv_capacity_from_either_servers_log(tmp_path):
    conveyor, vllm, other = tmp_path / "c.log", tmp_path / "v.log", tmp_path / "o.log"
    conveyor.write_text("x INFO engine ready: 1456 KV blocks x 16 tokens, max_len 8192, eos [2]\n")
    vllm.write_text("(EngineCore pid=1) INFO [kv_cache_utils.py:1] CPU KV cache size: 23,296 tokens, Maximum ...\n")
    other.write_text("nothing\n")
    assert kv_capacity_tokens(conveyor) == 23296
    assert kv_capacity_tokens(vllm) == 23296
    assert kv_capacity_tokens(other) is None
    assert kv_capacity_tokens(tmp_path / "missing.log") is None


def test_goal_from_turn_5(capsys):
    def res(p50s, tok_s):
        return {
            "per_turn": [{"turn": i + 1, "ttft_p50_ms": v, "ttft_p99_ms": v} for i, v in enumerate(p50s)],
            "output_tok_s": tok_s,
        }

    vllm = res([100, 200, 300, 400, 500, 600], 10.0)
    ok = report({"vllm": vllm, "conveyor": res([100, 100, 100, 100, 250, 300], 12.0)})
    assert ok["goal_ttft_half_from_turn5"] and ok["goal_throughput"]
    assert ok["ttft_p50_ratio_from_turn5"] == {5: 0.5, 6: 0.5}
    late = report({"vllm": vllm, "conveyor": res([100, 100, 100, 100, 100, 400], 9.0)})
    assert late["goal_ttft_half_from_turn5"] is False and late["goal_throughput"] is False
    short = report({"vllm": res([100, 200], 1.0), "conveyor": res([100, 100], 1.0)})
    assert short["goal_ttft_half_from_turn5"] is None  # no turn 5 (a smoke run)
    assert "TTFT by turn" in capsys.readouterr().out
