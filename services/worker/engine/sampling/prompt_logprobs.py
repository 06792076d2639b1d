"""Which prompt positions a step owes log probabilities for (a request's `prompt_logprobs`), for any runner.

Prompt token p's log probability (p >= 1; token 0 has none) comes from the logits of position p - 1, so a prefill
chunk computing positions [start, start + n) gives those of tokens start + 1 .. start + n, short of the last
prompt position (whose logits pick the first output token, as for any request). Only positions whose K/V are
computed have hidden states: a request that still owes prompt log probabilities is never served past what it has
from the prefix cache (or a session's kept KV) — the cache is bypassed for what it still needs, so the numbers are
the full forward's, cached prefix or not (docs/benchmarks.md measures what that costs). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.engine.request import Sequence

ROWS_PER_HEAD_CALL = 128  # prompt rows through the LM head at once: bounds the [rows, vocab] float32 logits


def owed(seq: Sequence, start: int, n: int) -> range:
    """Positions among [start, start + n) whose logits give a prompt log probability still owed (empty if none)."""
    if seq.prompt_lps is None:
        return range(0)
    return range(max(start, len(seq.prompt_lps)), min(start + n, seq.num_prompt_tokens - 1))


def max_cached_tokens(seq: Sequence) -> int | None:
    """The most tokens this sequence may take from the prefix cache at admission (None: no limit of ours): the
    positions whose logits it still needs must be computed."""
    return None if seq.prompt_lps is None else len(seq.prompt_lps)


@dataclass
class PromptJob:
    """One sequence's prompt log probabilities a step computes: the step's packed rows and the prompt token whose
    log probability each row's logits give."""

    seq: Sequence
    first: int  # the prompt position of targets[0]
    rows: list[int]
    targets: list[int]


def prompt_jobs(packed: list[tuple[Sequence, int]]) -> list[PromptJob]:
    """packed: (sequence, tokens computed from its num_computed_tokens) in the step's row order."""
    jobs, base = [], 0
    for seq, n in packed:
        start = seq.num_computed_tokens
        positions = owed(seq, start, n)
        if positions:
            jobs.append(
                PromptJob(
                    seq,
                    positions.start + 1,
                    [base + p - start for p in positions],
                    [seq.token_ids[p + 1] for p in positions],
                )
            )
        base += n
    return jobs
