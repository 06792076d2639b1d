"""Scheduler unit tests without a model: budgets, chunking, preemption policy, prefix reuse."""

from __future__ import annotations

import itertools

from services.worker.engine import EngineConfig, EngineRequest, SamplingOptions
from services.worker.engine.kv.block_manager import BlockManager
from services.worker.engine.request import Sequence, SequenceStatus
from services.worker.engine.scheduler import Scheduler

_ids = itertools.count()
GREEDY = SamplingOptions(temperature=0, max_tokens=100)


def make(num_blocks=16, block_size=4, budget=64, prefix=True, max_seqs=8):
    cfg = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix,
    )
    return Scheduler(cfg, BlockManager(num_blocks, block_size, prefix))


def seq(prompt_len, priority=0, first_token=1):
    req = EngineRequest(f"r{next(_ids)}", list(range(first_token, first_token + prompt_len)), GREEDY, priority)
    return Sequence(req, next(_ids), frozenset({0}))


def advance(sched: Scheduler, batch) -> None:
    """What the engine does after a forward: mark computed, sample a dummy token when due."""
    for s, n in batch.items:
        s.num_computed_tokens += n
        sched.register_computed_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            s.status = SequenceStatus.DECODING


def test_decodes_go_first_and_long_prompt_is_chunked():
    sched = make(budget=8, num_blocks=64)
    short = seq(3)
    sched.add(short)
    advance(sched, sched.schedule())  # short is now decoding
    long = seq(20)
    sched.add(long)
    sizes = []
    for _ in range(4):
        batch = sched.schedule()
        assert batch.items[0] == (short, 1), "the decode is scheduled before prefill work"
        sizes.append(dict((s.request_id, n) for s, n in batch.items).get(long.request_id))
        advance(sched, batch)
    assert sizes[:3] == [7, 7, 6], "the prompt is prefilled in budget-sized chunks"


def test_victim_is_least_important_and_goes_to_front():
    sched = make(num_blocks=6, block_size=4, budget=64)
    important, unimportant, other = seq(8, 0, 100), seq(8, 5, 200), seq(8, 0, 300)
    for s in (important, unimportant, other):
        sched.add(s)
    advance(sched, sched.schedule())  # 2 blocks each: the pool is full
    batch = sched.schedule()  # every sequence now needs a third block
    assert [t for t in batch.transitions if t[1] == "PREEMPTED"] == [(unimportant.request_id, "PREEMPTED")]
    assert sched.waiting[0] is unimportant and unimportant.status == SequenceStatus.PREEMPTED
    assert unimportant.block_table == [] and unimportant.num_computed_tokens == 0
    assert {s for s, _ in batch.items} == {important, other}
    assert sched.num_preemptions == 1


def test_among_equal_priorities_the_newest_is_preempted():
    sched = make(num_blocks=5, block_size=4, budget=64)
    older, newer = seq(8, 0, 100), seq(8, 0, 200)
    sched.add(older)
    sched.add(newer)
    advance(sched, sched.schedule())
    sched.blocks.allocate(1)  # someone else holds the last free block
    batch = sched.schedule()
    assert [t[0] for t in batch.transitions] == [newer.request_id]
    assert batch.items == [(older, 1)]


def test_prefix_hits_never_cover_the_last_prompt_token():
    sched = make(num_blocks=16, block_size=4)
    first = seq(8)
    sched.add(first)
    advance(sched, sched.schedule())
    sched.remove(first)
    again = seq(8)  # identical prompt: 2 full cached blocks, but the last token must be computed
    sched.add(again)
    batch = sched.schedule()
    assert again.num_cached_tokens == 4
    assert batch.items == [(again, 4)]


def test_admission_waits_when_blocks_run_out():
    sched = make(num_blocks=3, block_size=4)
    a, b = seq(8), seq(8)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s for s, _ in batch.items] == [a], "b does not fit and waits at the head of the queue"
    assert list(sched.waiting) == [b]


def test_max_num_seqs_caps_running():
    sched = make(max_seqs=2)
    for _ in range(3):
        sched.add(seq(2))
    batch = sched.schedule()
    assert len(batch.items) == 2 and len(sched.waiting) == 1


def session_seq(prompt_len, session="conv-1", first_token=1):
    req = EngineRequest(
        f"r{next(_ids)}", list(range(first_token, first_token + prompt_len)), GREEDY, session_id=session
    )
    return Sequence(req, next(_ids), frozenset({0}))


def make_capped(cap, budget=64):
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=256, max_num_batched_tokens=budget, max_num_seqs=8, session_prefill_tokens=cap
    )
    return Scheduler(cfg, BlockManager(256, 4, True))


def prompt_tokens(batch) -> int:
    return sum(n for s, n in batch.items if s.status != SequenceStatus.DECODING)


def test_a_waiting_session_turn_caps_the_steps_prompt_tokens():
    sched = make_capped(cap=16)
    running = seq(3)
    sched.add(running)
    advance(sched, sched.schedule())  # now decoding
    turns = [session_seq(30, f"conv-{i}", 100 * i) for i in range(3)]
    for t in turns:
        sched.add(t)
    batch = sched.schedule()
    assert (running, 1) in batch.items, "the decodes run as ever"
    assert prompt_tokens(batch) == 16, "prompt tokens held to session_prefill_tokens"


def test_a_session_turn_in_prefill_keeps_the_cap_until_its_first_token():
    sched = make_capped(cap=16)
    running = seq(3)
    sched.add(running)
    advance(sched, sched.schedule())  # now decoding: the steps are shared
    turn = session_seq(40, first_token=100)
    sched.add(turn)
    sizes = []
    while turn.num_outputs == 0:
        batch = sched.schedule()
        sizes.append(prompt_tokens(batch))
        advance(sched, batch)
    assert sizes == [16, 16, 8], "each step of the turn's prefill computes at most the cap"


def test_without_sessions_a_step_keeps_its_whole_budget():
    sched = make_capped(cap=16)
    for i in range(3):
        sched.add(seq(30, first_token=100 * i))
    assert prompt_tokens(sched.schedule()) == 64


def test_session_prefill_tokens_zero_keeps_the_whole_budget():
    sched = make_capped(cap=0)
    for i in range(3):
        sched.add(session_seq(30, f"conv-{i}", 100 * i))
    assert prompt_tokens(sched.schedule()) == 64


def test_the_session_prefill_setting_reaches_the_engine():
    from services.worker.build import engine_config
    from shared.settings import WorkerSettings

    assert engine_config(WorkerSettings(session_prefill_tokens=128)).session_prefill_tokens == 128
    assert engine_config(WorkerSettings()).session_prefill_tokens == 256


def test_a_session_turn_alone_prefills_with_the_whole_budget():
    sched = make_capped(cap=16)
    sched.add(session_seq(100))
    assert prompt_tokens(sched.schedule()) == 64, "no one to share the steps with"


def make_overshoot(overshoot=32, budget=512):
    cfg = EngineConfig(
        block_size=16,
        num_kv_blocks=512,
        max_num_batched_tokens=budget,
        max_num_seqs=64,
        prefill_overshoot_tokens=overshoot,
    )
    return Scheduler(cfg, BlockManager(512, 16, True))


def chunks_until_first_token(sched: Scheduler, prompt: Sequence) -> list[int]:
    sizes = []
    while prompt.num_outputs == 0:
        batch = sched.schedule()
        sizes.append(dict((s.request_id, n) for s, n in batch.items).get(prompt.request_id, 0))
        advance(sched, batch)
    return sizes


def test_a_prompt_a_few_tokens_over_the_budget_is_finished_in_one_step():
    sched = make_overshoot()
    prompt = seq(515)
    sched.add(prompt)
    assert chunks_until_first_token(sched, prompt) == [515], "not 512 and then a step for its last 3 tokens"


def test_a_burst_of_prompts_just_over_the_budget_gets_a_first_token_every_step():
    sched = make_overshoot()
    burst = [seq(515, first_token=1000 * i) for i in range(8)]
    for s in burst:
        sched.add(s)
    steps_to_first = {}
    for step in range(1, 12):
        advance(sched, sched.schedule())
        for s in burst:
            if s.num_outputs and s.request_id not in steps_to_first:
                steps_to_first[s.request_id] = step
    assert [steps_to_first[s.request_id] for s in burst] == list(range(1, 9)), "each one step, beside the decodes"


def test_a_prompt_well_over_the_budget_is_chunked_at_the_budget():
    sched = make_overshoot()
    prompt = seq(600)
    sched.add(prompt)
    assert chunks_until_first_token(sched, prompt) == [512, 88]


def test_the_overshoot_is_at_most_a_sixteenth_of_the_room():
    sched = make_overshoot(overshoot=32, budget=64)  # a sixteenth: 4 tokens
    near, far = seq(68), seq(69, first_token=500)
    sched.add(near)
    assert chunks_until_first_token(sched, near) == [68]
    sched.add(far)
    assert chunks_until_first_token(sched, far) == [63, 6], "beside near's decode: 63 of room, 6 over the 3 allowed"


def test_prefill_overshoot_zero_keeps_the_budget_strict():
    sched = make_overshoot(overshoot=0)
    prompt = seq(515)
    sched.add(prompt)
    assert chunks_until_first_token(sched, prompt) == [512, 3]


def test_the_prefill_overshoot_setting_reaches_the_engine():
    from services.worker.build import engine_config
    from shared.settings import WorkerSettings

    assert engine_config(WorkerSettings(prefill_overshoot_tokens=0)).prefill_overshoot_tokens == 0
    assert engine_config(WorkerSettings()).prefill_overshoot_tokens == 32
