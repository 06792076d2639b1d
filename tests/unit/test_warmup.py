"""The start-up warm-up (engine/warmup.py) on the real scheduler and block pool with the simulated runner: one
step of every prefill and decode shape bucket, bounded in time, the engine left as it was."""

from __future__ import annotations

import pytest

from services.worker.engine import EngineConfig, LLMEngine
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import SimRunner
from services.worker.engine.warmup import plan, warm_up

TIMING = SimTiming(step_overhead_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0, decode_s_per_kv_token=0.0)


@pytest.fixture
def engine(vocab):
    cfg = EngineConfig(num_kv_blocks=256, block_size=16, max_num_batched_tokens=256, max_num_seqs=32)
    runner = SimRunner(TIMING, vocab, 256, 0.0, sleep=lambda s: None)
    return LLMEngine(runner, cfg, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)


def record_steps(engine: LLMEngine) -> list[tuple[int, int]]:
    """-> the (prefill tokens, decode tokens) of every step the engine takes from now on."""
    shapes, step = [], engine.step

    def recording(*args, **kwargs):
        r = step(*args, **kwargs)
        if r.num_seqs:
            shapes.append((r.num_prefill_tokens, r.num_decode_tokens))
        return r

    engine.step = recording
    return shapes


def test_the_plan_covers_every_power_of_two_bucket_up_to_the_step_budget_and_the_batch_limit():
    cfg = EngineConfig(block_size=16, max_num_batched_tokens=512, max_num_seqs=64)
    prefill, decode = plan(cfg, max_len=8192)
    assert prefill == [16, 32, 64, 128, 256, 512, 1024]  # 1024: a chunk continuing a computed context
    assert decode == [64, 32, 16, 8, 4, 2, 1]


def test_the_plan_leaves_out_prompts_the_context_window_cannot_hold():
    prefill, _ = plan(EngineConfig(block_size=16, max_num_batched_tokens=512), max_len=300)
    assert prefill == [16, 32, 64, 128, 256]


def test_warm_up_runs_one_step_of_every_decode_batch_size_and_every_prefill_size(engine):
    shapes = record_steps(engine)
    report = warm_up(engine, budget_s=60)
    assert report.prefill_sizes == [16, 32, 64, 128, 256, 512] and report.skipped == []
    assert report.decode_batches == [32, 16, 8, 4, 2, 1]
    decode_batches = {d for p, d in shapes if p == 0}
    assert {32, 16, 8, 4, 2, 1} <= decode_batches
    assert {p for p, d in shapes if d == 0} >= {16, 32, 64, 128, 256}  # the 512 prompt: two chunks of 256


def test_warm_up_leaves_nothing_running_waiting_or_held(engine):
    warm_up(engine, budget_s=60)
    assert not engine.has_unfinished() and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.step().outputs == []  # no output of a warm-up request reaches the first client
    engine.check_no_leak()


def test_a_warm_up_out_of_time_runs_the_smallest_prefill_only(engine):
    shapes = record_steps(engine)
    report = warm_up(engine, budget_s=0)
    assert report.prefill_sizes == [16] and report.decode_batches == []
    assert "decode 1" in report.skipped and "prefill 512" in report.skipped
    assert shapes == [(16, 0)]
    engine.check_no_leak()
