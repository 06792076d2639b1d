"""What one engine step returns, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire.events import Reason, State


@dataclass(frozen=True)
class TokenLogprobs:
    """Log probabilities of one sampled token (sampler.py says of which distribution): its own, and the
    request's `logprobs` most likely tokens, most likely first."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # of the token among all (1 = most likely); prompt log probabilities only (0 = not computed)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    first_index: int  # index in the request's whole output of new_token_ids[0]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos/stop token, included) or "length"
    error_reason: Reason | None = None  # too_long, oom, worker_error (engine/errors.py) when the request failed
    error: str | None = None  # human-readable detail of error_reason
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at its first admission)
    logprobs: list[TokenLogprobs] | None = None  # one per new_token_ids, when the request asked for them
    # with the first output token of a request that asked for prompt_logprobs: prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list[TokenLogprobs] | None = None
    session_blocks: int = 0  # finished: KV blocks kept for its session's next turn (session_kv.py)


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    transitions: list[tuple[str, State]] = field(default_factory=list)  # (request_id, its lifecycle state now)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0  # the model call alone (synchronised on CUDA)


@dataclass
class EngineStats:
    total_blocks: int
    free_blocks: int  # free + cached-and-unreferenced (evictable)
    cached_blocks: int  # blocks holding a registered prefix hash (referenced or not)
    block_size: int
    num_running: int
    num_waiting: int
    max_num_seqs: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens served from the cache
    prefill_s_per_token: float  # moving averages of forward time per token
    decode_s_per_token: float
    decode_tokens_left: int = 0  # output tokens its sequences may still produce (max_tokens less what they have)
    sessions: dict[str, int] = field(default_factory=dict)  # SessionKV.figures(): paused / swapped sessions, blocks
    num_drafted: int = 0  # speculative decoding (spec.py): draft tokens checked, and those the model agreed with
    num_draft_accepted: int = 0


def step_line(step_no: int, result: StepResult, stats: EngineStats, total_s: float) -> str:
    """One engine step in one line (the worker logs it at DEBUG): what a run's time went to, step by step, without
    a profiler: the step's and its forward's time, the whole step with its publish, the tokens it computed, the
    queues after it, and the running totals of swaps and preemptions (the difference to the line before is this
    step's)."""
    s = stats.sessions
    return (
        f"step {step_no}: {result.step_time_s * 1e3:.1f} ms (forward {result.forward_time_s * 1e3:.1f}, "
        f"with publish {total_s * 1e3:.1f}), prefill {result.num_prefill_tokens} tokens, decode "
        f"{result.num_decode_tokens}, running {stats.num_running}, waiting {stats.num_waiting}; totals: swap-outs "
        f"{s.get('kv_swap_outs', 0)}, swap-ins {s.get('kv_swap_ins', 0)}, preemptions {stats.num_preemptions}"
    )
