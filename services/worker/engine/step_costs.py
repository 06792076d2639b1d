"""What the engine's steps cost and yield, kept as running figures (the scheduler's admission and refusal read the
per-token costs through the worker's heartbeats; the draft counts say what speculative decoding buys)."""

from __future__ import annotations

from services.worker.engine.outputs import StepResult
from services.worker.engine.request import Sequence, SequenceStatus

_EMA = 0.1  # weight of the newest step in the per-token time averages


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EMA) * old + _EMA * new


class StepCosts:
    def __init__(self) -> None:
        self.prefill_s_per_token = 0.0
        self.decode_s_per_token = 0.0  # per decoding sequence and step (its drafts' rows included)
        self.num_drafted = 0  # draft tokens checked (spec.py)
        self.num_draft_accepted = 0  # of them, those the model agreed with

    def account(self, items: list[tuple[Sequence, int]], forward_s: float, result: StepResult) -> None:
        decode = sum(1 for s, n in items if s.status == SequenceStatus.DECODING)  # drafts ride on their decode
        prefill = sum(n for s, n in items if s.status != SequenceStatus.DECODING)
        result.num_decode_tokens += decode
        result.num_prefill_tokens += prefill
        result.num_seqs += len(items)
        result.forward_time_s += forward_s
        if prefill == 0:
            self.decode_s_per_token = _ema(self.decode_s_per_token, forward_s / decode)
        else:  # decode tokens of a mixed step are charged at the current decode estimate
            rest = max(forward_s - decode * self.decode_s_per_token, 0.0)
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, rest / prefill)

    def drafts_checked(self, drafted: int, accepted: int) -> None:
        self.num_drafted += drafted
        self.num_draft_accepted += accepted
