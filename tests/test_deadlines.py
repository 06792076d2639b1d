"""Adaptive deadlines as a pure policy: an allowance fixed in work, priced with the latest measured costs."""

from __future__ import annotations

from types import SimpleNamespace

from services.scheduler.deadlines import Costs, DeadlinePolicy, Work

POLICY = DeadlinePolicy(factor=1.5, min_s=5.0, max_s=300.0)
AHEAD, OWN = Work(prefill_tokens=3200, decode_tokens=1600), Work(prefill_tokens=32, decode_tokens=16)


def costs(step_s: float, prefill_s: float = 0.001, seqs: int = 64) -> Costs:
    return Costs.of([SimpleNamespace(prefill_s_per_token=prefill_s, step_time_s=step_s, decode_s_per_token=step_s,
                                     max_num_seqs=seqs)])


def test_a_machine_three_times_slower_stretches_the_allowance_three_times():
    quiet, busy = costs(0.05, 0.001), costs(0.15, 0.003)
    d_quiet = POLICY.deadline(0.0, 1e9, quiet.seconds(AHEAD, OWN))
    d_busy = POLICY.deadline(0.0, 1e9, busy.seconds(AHEAD, OWN))
    assert abs(d_busy - 3 * d_quiet) < 1e-6


def test_prefill_ahead_is_serial_and_decode_ahead_is_shared_by_the_batch():
    c = costs(0.1, 0.001, seqs=64)
    assert abs(c.seconds(AHEAD, OWN) - ((3200 + 32) * 0.001 + (1600 / 64 + 16) * 0.1)) < 1e-9


def test_the_allowance_is_clamped_to_the_floor_and_the_cap():
    c = costs(0.001)
    assert POLICY.deadline(100.0, 1e9, c.seconds(Work(0, 0), Work(1, 1))) == 105.0
    assert POLICY.deadline(100.0, 150.0, 1e6) == 150.0


def test_no_measured_worker_gives_no_prediction():
    assert Costs.of([]) is None
