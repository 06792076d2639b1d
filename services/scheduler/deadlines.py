"""Adaptive deadlines for requests that gave no timeout: how long a request may wait in the queue.

A request's allowance is fixed in *work* when it is queued (prompt tokens to prefill and tokens to decode,
its own and of everything queued ahead of it) and priced in *time* with the workers' latest measured costs
each time it is judged. A machine that gets busy (its steps get slower) stretches every allowance with
it; a queue that does not move (no worker making progress) is caught once the allowance at the current
speed has passed. Once a worker holds the request only the cap applies (the default timeout): a request
that is generating is never killed by a prediction. Pure: no Redis, tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """Work between a request's arrival and its end, in tokens."""

    prefill_tokens: int  # prompt tokens to compute (its own and those ahead of it): serial compute
    decode_tokens: int  # tokens to generate (its own and those ahead): shared by the running batch


@dataclass(frozen=True)
class Costs:
    """Latest measured costs, averaged over live workers."""

    prefill_s_per_token: float
    decode_s_per_step: float  # one step of the running batch
    slots: int  # sequences decoded at once, summed over workers
    decode_left: int = 0  # output tokens the workers' own requests may still produce, summed over workers
    free_slots: int = 0  # sequence slots no request holds now, summed over workers that take work

    @classmethod
    def of(cls, heartbeats: list) -> "Costs | None":
        if not heartbeats:
            return None
        n = len(heartbeats)
        return cls(
            prefill_s_per_token=sum(h.prefill_s_per_token for h in heartbeats) / n,
            decode_s_per_step=sum(h.step_time_s or h.decode_s_per_token for h in heartbeats) / n,
            slots=max(1, sum(h.max_num_seqs for h in heartbeats if not h.draining)),
            decode_left=sum(getattr(h, "decode_tokens_left", 0) for h in heartbeats),
            free_slots=sum(
                max(0, h.max_num_seqs - h.num_running - h.num_waiting) for h in heartbeats if not h.draining
            ),
        )

    def wait_to_start(self, ahead: Work, requests_ahead: int) -> float:
        """Predicted time before a request could start: none while a slot is free for it (fewer requests queued
        ahead than free slots), else the steps the work queued ahead of it and what the workers hold take to decode
        (their slots free up as that decodes). In whole steps only: a step's measured time already holds the chunked
        prefill done in it, so the prompts ahead are not priced again."""
        if requests_ahead < self.free_slots:
            return 0.0
        return (ahead.decode_tokens + self.decode_left) / self.slots * self.decode_s_per_step

    def seconds(self, ahead: Work, own: Work) -> float:
        """Predicted time from arrival to the end: the work ahead (decode shared by every slot), then its own
        (its decode takes one step per token whatever the batch)."""
        prefill = (ahead.prefill_tokens + own.prefill_tokens) * self.prefill_s_per_token
        return prefill + (ahead.decode_tokens / self.slots + own.decode_tokens) * self.decode_s_per_step


@dataclass(frozen=True)
class DeadlinePolicy:
    factor: float  # allowance = factor x predicted time
    min_s: float
    max_s: float

    def deadline(self, received_at: float, cap: float, predicted_s: float) -> float:
        budget = min(max(self.factor * predicted_s, self.min_s), self.max_s)
        return min(cap, received_at + budget)


def work_of(prompt_tokens: int, output_left: int) -> Work:
    return Work(prompt_tokens, output_left)


def total(works) -> Work:
    works = list(works)
    return Work(sum(w.prefill_tokens for w in works), sum(w.decode_tokens for w in works))
