"""The gateway's Prometheus figures (`GET /metrics`, names after vLLM's with a `conveyor:` prefix): its own
histograms and counters, observed once per request as it is released, and the cluster's gauges, read from Redis
at scrape time. A request's own metrics are services.gateway.session.timing's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.gateway.session.outcome import ending
from shared.process import liveness
from shared.wire.constants import Names
from shared.state.lifecycle import TERMINAL, State
from shared.state.sessions import SESSION_FIGURES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# Token counts and request parameters: vLLM's 1-2-5 series (its build_1_2_5_buckets), so dashboards carry over.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
N_BUCKETS = (1, 2, 5, 10, 20)
LIVE_STATES = [s for s in State if s not in TERMINAL]


class GatewayMetrics:
    """This gateway's histograms and counters; cluster gauges are read from Redis at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def h(name: str, doc: str) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counts(name: str, doc: str, buckets=TOKEN_BUCKETS) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, buckets=buckets, registry=self.registry)

        def c(name: str, doc: str, labels=()) -> Counter:
            return Counter(f"conveyor:{name}", doc, labels, registry=self.registry)

        self.ttft = h("time_to_first_token_seconds", "receipt to first token sent to the client")
        self.itl = h("inter_token_latency_seconds", "time between two deliveries of tokens to a client")
        self.e2e = h("e2e_request_latency_seconds", "receipt to final answer")
        self.queue = h("request_queue_time_seconds", "time in QUEUED (history)")
        self.prefill = h("request_prefill_time_seconds", "PREFILLING to first token (history)")
        self.decode = h("request_decode_time_seconds", "first token to the end (history)")
        self.request_prompt_tokens = counts("request_prompt_tokens", "prompt tokens per finished request (choice)")
        self.request_generation_tokens = counts("request_generation_tokens", "output tokens per finished request")
        self.request_params_n = counts("request_params_n", "n per accepted request (its choices)", N_BUCKETS)
        self.request_params_max_tokens = counts("request_params_max_tokens", "max_tokens per accepted request")
        self.prompt_tokens = c("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens", "tokens sent to clients")
        self.success = c("request_success", "finished requests", ["finished_reason"])
        self.failure = c("request_failure", "failed requests", ["reason"])
        self.timeouts = c("timeouts", "requests that timed out")
        self.cancellations = c("cancellations", "cancelled requests", ["reason"])

    def observe_end(self, end, m: dict, token_times: list[float], n_tokens: int) -> None:
        """Called exactly once per request, by the gateway holding its client, with its terminal event."""
        how = ending(end)
        for gap in (b - a for a, b in zip(token_times, token_times[1:])):
            self.itl.observe(gap)
        for hist, key in (
            (self.ttft, "ttft"),
            (self.e2e, "e2e"),
            (self.queue, "queue_wait"),
            (self.prefill, "prefill_time"),
            (self.decode, "decode_time"),
        ):
            if m.get(key) is not None:
                hist.observe(m[key])
        self.generation_tokens.inc(n_tokens)
        if how.outcome.ok:
            self.prompt_tokens.inc(getattr(end, "prompt_tokens", 0))
            self.request_prompt_tokens.observe(getattr(end, "prompt_tokens", 0))
            self.request_generation_tokens.observe(n_tokens)
        if how.outcome.counter is None:  # no ending reached the request: nothing to count
            return
        counter = getattr(self, how.outcome.counter)
        (counter.labels(how.reason) if how.outcome.labelled else counter).inc()

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        """Called once per accepted request (all its choices): the parameters vLLM's histograms count."""
        self.request_params_n.observe(n)
        if max_tokens is not None:  # None: until the context's end, no number to count
            self.request_params_max_tokens.observe(max_tokens)

    async def render(self, r, names: Names) -> bytes:
        cluster = CollectorRegistry()
        cluster.register(_Snapshot(await cluster_figures(r, names)))
        return generate_latest(self.registry) + generate_latest(cluster)


async def cluster_figures(r, names: Names) -> dict:
    """Cluster-wide figures: live workers' last heartbeats (their liveness entries) and the state sets."""
    workers = list((await liveness.aread_live(r, names, "worker")).values())
    pipe = r.pipeline(transaction=False)
    for p in names.all_partitions:  # one set per partition: the figure is their sum
        pipe.zcard(names.waiting(p))
        for s in LIVE_STATES:
            pipe.zcard(names.state_set(p, s.value))
    per = len(LIVE_STATES) + 1
    counts = [sum(c) for c in zip(*_chunks(await pipe.execute(), per))]
    total = sum(w.get("total_blocks", 0) for w in workers)
    return {
        "waiting": counts[0],
        "states": dict(zip((s.value for s in LIVE_STATES), counts[1:])),
        "running": sum(w.get("running", 0) for w in workers),
        "waiting_capacity": sum(w.get("waiting", 0) for w in workers),
        "caches": [(w.get("block_size", 0), w.get("total_blocks", 0)) for w in workers],
        "kv_usage": 1.0 - sum(w.get("free_blocks", 0) for w in workers) / total if total else 0.0,
        "preemptions": sum(w.get("preemptions", 0) for w in workers),
        "prefix_queries": sum(w.get("prefix_cache_queries", 0) for w in workers),
        "prefix_hits": sum(w.get("prefix_cache_hits", 0) for w in workers),
        "drafted": sum(w.get("num_drafted", 0) for w in workers),
        "draft_accepted": sum(w.get("num_draft_accepted", 0) for w in workers),
        **{k: sum(w.get(k, 0) for w in workers) for k in SESSION_FIGURES},
    }


class _Snapshot:
    """A one-scrape collector over figures read from Redis."""

    def __init__(self, f: dict):
        self.f = f

    def collect(self):
        yield from self._requests()
        yield from self._worker_counters()
        yield from self._sessions()

    def _requests(self):
        """Where the live requests are: running, waiting (and why), per state; the workers' KV caches."""
        f = self.f
        yield GaugeMetricFamily("conveyor:num_requests_running", "sequences running on workers", f["running"])
        yield GaugeMetricFamily("conveyor:num_requests_waiting", "requests not yet on a worker", f["waiting"])
        yield GaugeMetricFamily("conveyor:kv_cache_usage_perc", "share of KV blocks in use (0..1)", f["kv_usage"])
        # vLLM's reasons: queued (not placed yet: the scheduler's queue), capacity (on a worker, waiting for KV room).
        by_reason = GaugeMetricFamily(
            "conveyor:num_requests_waiting_by_reason", "requests waiting, by why", labels=["reason"]
        )
        by_reason.add_metric(["queued"], f["waiting"])
        by_reason.add_metric(["capacity"], f["waiting_capacity"])
        yield by_reason
        info = GaugeMetricFamily(
            "conveyor:cache_config_info", "a live worker's KV cache (value 1)", labels=["block_size", "num_blocks"]
        )
        for block_size, num_blocks in sorted(set(f["caches"])):
            info.add_metric([str(block_size), str(num_blocks)], 1)
        yield info
        states = GaugeMetricFamily("conveyor:num_requests_in_state", "live requests per state", labels=["state"])
        for state, n in f["states"].items():
            states.add_metric([state], n)
        yield states

    def _worker_counters(self):
        f = self.f
        # Workers count these since their start (summed over live workers).
        yield CounterMetricFamily("conveyor:num_preemptions", "preemptions on live workers", f["preemptions"])
        yield CounterMetricFamily("conveyor:prefix_cache_queries", "prompt tokens looked up", f["prefix_queries"])
        yield CounterMetricFamily("conveyor:prefix_cache_hits", "prompt tokens found cached", f["prefix_hits"])
        # vLLM's names: speculative decoding's draft tokens checked and accepted
        yield CounterMetricFamily(
            "conveyor:spec_decode_num_draft_tokens", "draft tokens checked (prompt lookup)", f["drafted"]
        )
        yield CounterMetricFamily(
            "conveyor:spec_decode_num_accepted_tokens", "draft tokens the model agreed with", f["draft_accepted"]
        )

    def _sessions(self):
        """Paused sessions and their KV, in memory and on disk, and the runs copied between the two."""
        f = self.f
        yield GaugeMetricFamily(
            "conveyor:num_sessions_paused", "sessions whose KV a live worker keeps between turns", f["sessions_paused"]
        )
        yield GaugeMetricFamily(
            "conveyor:num_sessions_swapped",
            "paused sessions whose KV is in a worker's disk tier",
            f["sessions_swapped"],
        )
        tiers = GaugeMetricFamily(
            "conveyor:session_kv_blocks", "KV blocks paused sessions hold, per tier", labels=["tier"]
        )
        tiers.add_metric(["memory"], f["session_blocks_paused"])
        tiers.add_metric(["disk"], f["session_blocks_swapped"])
        yield tiers
        yield CounterMetricFamily(
            "conveyor:kv_swap_outs",
            "KV runs live workers copied to their disk tier (paused, parked)",
            f["kv_swap_outs"],
        )
        yield CounterMetricFamily("conveyor:kv_swap_ins", "KV runs live workers copied back from it", f["kv_swap_ins"])


def _chunks(xs: list, n: int) -> list[list]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]
