"""A session's KV kept in the engine between turns (session_kv.py), on the real scheduler and block pool with the
simulated runner: kept at the end of a turn, found by the next, reclaimed before anyone waits or is preempted,
released when idle or closed."""

from __future__ import annotations

import pytest

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import SimRunner
from shared.wire.events import SessionReason

TIMING = SimTiming(step_overhead_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0, decode_s_per_kv_token=0.0)
BS = 16


@pytest.fixture
def make_engine(vocab):
    def build(num_kv_blocks: int = 256, **overrides) -> LLMEngine:
        settings = {"num_kv_blocks": num_kv_blocks, "block_size": BS, "max_num_batched_tokens": 4096, **overrides}
        cfg = EngineConfig(**settings)
        runner = SimRunner(TIMING, vocab, num_kv_blocks, 0.0, sleep=lambda s: None)
        return LLMEngine(runner, cfg, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)

    return build


def turn(engine: LLMEngine, rid: str, prompt: list[int], session: str = "", max_tokens: int = 8):
    """Run one request to its end -> (its output tokens, its final RequestOutput)."""
    engine.add_request(
        EngineRequest(rid, prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens), session_id=session)
    )
    tokens, last = [], None
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.request_id == rid:
                tokens += o.new_token_ids
                last = o
    kept = engine.sessions  # its running count of pool blocks is what it holds
    assert kept.pool_blocks == sum(len(k.blocks) for k in kept.kept.values())
    return tokens, last


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_a_finished_session_turn_keeps_its_computed_full_blocks(make_engine):
    engine = make_engine()
    _, end = turn(engine, "t1", prompt(100), session="s")
    # 100 prompt tokens + 7 outputs computed (the last output is sampled, not computed): 6 full blocks
    assert end.session_blocks == 6
    assert engine.stats().sessions == {
        "sessions_paused": 1,
        "sessions_swapped": 0,
        "session_blocks_paused": 6,
        "session_blocks_swapped": 0,
        "kv_swap_outs": 0,
        "kv_swap_ins": 0,
    }


def test_the_next_turn_of_a_session_finds_the_conversation_so_far_in_the_cache(make_engine):
    engine = make_engine()
    first = prompt(100)
    out, _ = turn(engine, "t1", first, session="s")
    _, end = turn(engine, "t2", first + out + prompt(20, start=5000), session="s")
    assert end.num_cached_tokens == 6 * BS
    assert engine.stats().sessions["sessions_paused"] == 1  # the second turn's KV replaced the first's


def test_a_request_without_a_session_keeps_nothing(make_engine):
    engine = make_engine()
    _, end = turn(engine, "t1", prompt(100))
    assert end.session_blocks == 0
    engine.check_no_leak()


@pytest.mark.parametrize("session", ["a", ""], ids=["kept", "not-kept"])
def test_a_paused_session_outlives_the_eviction_of_unkept_cached_prefixes(make_engine, session):
    engine = make_engine(num_kv_blocks=64)
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session=session)  # kept or not: 6 blocks
    turn(engine, "b1", prompt(100, start=3000))  # cached, not kept: 7 blocks evictable
    turn(engine, "c1", prompt(57 * BS - 8, start=8000), max_tokens=1)  # needs 57: takes the free and evicts
    _, end = turn(engine, "a2", convo + out + [7], session=session)
    if session:
        assert end.num_cached_tokens == 6 * BS
    else:  # the plain prefix cache lost most of the conversation to c1
        assert end.num_cached_tokens < 6 * BS


def test_under_pressure_a_paused_session_is_released_before_anyone_is_preempted(make_engine):
    engine = make_engine(num_kv_blocks=32)
    turn(engine, "a1", prompt(100), session="a")  # kept: 6 of 32 blocks
    engine.take_session_events()
    _, end = turn(engine, "big", prompt(30 * BS, start=9000), max_tokens=4)  # needs 31 blocks
    assert end.finish_reason == "length"
    assert engine.stats().num_preemptions == 0
    events = engine.take_session_events()
    assert [(e.session, e.request_id, e.what, e.reason) for e in events] == [
        ("a", "a1", "released", SessionReason.PRESSURE)
    ]
    engine.check_no_leak()


def test_the_blocks_a_paused_session_holds_count_as_free_in_the_engine_figures(make_engine):
    engine = make_engine(num_kv_blocks=64)
    turn(engine, "a1", prompt(100), session="a")
    assert engine.stats().free_blocks == 64  # kept blocks are reclaimable: the scheduler may place work here


def test_a_session_idle_past_the_ttl_has_its_kv_released(make_engine):
    engine = make_engine()
    turn(engine, "a1", prompt(100), session="a")
    engine.take_session_events()
    engine.expire_sessions(3600.0)
    assert engine.stats().sessions["sessions_paused"] == 1  # not idle long enough
    engine.expire_sessions(0.0)
    assert [(e.what, e.reason) for e in engine.take_session_events()] == [("released", SessionReason.IDLE)]
    engine.check_no_leak()


def test_closing_a_session_releases_its_kv(make_engine):
    engine = make_engine()
    turn(engine, "a1", prompt(100), session="a")
    engine.close_session("a")
    engine.check_no_leak()


def test_an_aborted_session_turn_keeps_nothing(make_engine):
    engine = make_engine()
    engine.add_request(EngineRequest("a1", prompt(100), SamplingOptions(max_tokens=50), session_id="a"))
    engine.step()
    engine.abort_request("a1")
    assert engine.stats().sessions["sessions_paused"] == 0
    engine.check_no_leak()


def test_a_session_limited_to_fewer_blocks_keeps_the_leading_ones(make_engine):
    engine = make_engine(session_max_blocks=2)
    convo = prompt(100)
    out, end = turn(engine, "a1", convo, session="a")
    assert end.session_blocks == 2
    _, nxt = turn(engine, "a2", convo + out + [5], session="a")
    assert nxt.num_cached_tokens >= 2 * BS


def swap_engine(make_engine, tmp_path, **overrides) -> LLMEngine:
    return make_engine(num_kv_blocks=32, session_swap_dir=str(tmp_path / "tier"), **overrides)


def squeeze(engine: LLMEngine) -> None:
    """A request that needs 31 of the pool's 32 blocks: every paused session must give its blocks back."""
    _, end = turn(engine, "big", prompt(30 * BS, start=9000), max_tokens=4)
    assert end.finish_reason == "length" and engine.stats().num_preemptions == 0


def test_under_pressure_a_paused_session_moves_to_the_disk_tier_and_its_next_turn_swaps_it_back(make_engine, tmp_path):
    engine = swap_engine(make_engine, tmp_path)
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session="a")
    squeeze(engine)
    assert [(e.what, e.reason) for e in engine.take_session_events()] == [("swapped", SessionReason.PRESSURE)]
    assert engine.stats().sessions["sessions_swapped"] == 1
    _, end = turn(engine, "a2", convo + out + [7], session="a")
    assert end.num_cached_tokens == 6 * BS
    assert engine.sessions.swap_ins == 1 and engine.sessions.tier.num_entries == 0
    assert engine.stats().sessions["sessions_swapped"] == 0


def test_the_stats_count_every_swap_out_and_swap_in_since_start(make_engine, tmp_path):
    engine = swap_engine(make_engine, tmp_path)
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session="a")
    squeeze(engine)
    turn(engine, "a2", convo + out + [7], session="a")
    assert (engine.stats().sessions["kv_swap_outs"], engine.stats().sessions["kv_swap_ins"]) == (1, 1)


def test_a_corrupt_swapped_entry_is_recomputed_never_read(make_engine, tmp_path):
    engine = swap_engine(make_engine, tmp_path)
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session="a")
    squeeze(engine)
    engine.take_session_events()
    for f in (tmp_path / "tier").iterdir():
        if f.is_file() and f.stat().st_size > 0:
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF  # one bit of the payload flipped
            f.write_bytes(bytes(data))
    _, end = turn(engine, "a2", convo + out + [7], session="a")
    assert end.num_cached_tokens < 6 * BS and engine.sessions.swap_in_failures == 1  # what the pool still had
    assert [e.what for e in engine.take_session_events()] == ["released"]


def test_a_paused_session_shorter_than_the_swap_threshold_is_released_not_swapped(make_engine, tmp_path):
    engine = swap_engine(make_engine, tmp_path, session_swap_min_tokens=512)
    turn(engine, "a1", prompt(100), session="a")  # 96 tokens kept: below 512
    squeeze(engine)
    assert [e.what for e in engine.take_session_events()] == ["released"]


def test_a_turn_of_another_conversation_under_a_swapped_session_id_drops_the_swapped_kv(make_engine, tmp_path):
    engine = swap_engine(make_engine, tmp_path)
    turn(engine, "a1", prompt(100), session="a")
    squeeze(engine)
    engine.take_session_events()
    _, end = turn(engine, "a2", prompt(100, start=20000), session="a")
    assert end.num_cached_tokens == 0 and engine.sessions.swap_ins == 0
    assert engine.sessions.tier.num_entries == 0


def test_a_preempted_request_parks_its_kv_in_the_tier_and_swaps_it_back_instead_of_recomputing(make_engine, tmp_path):
    engine = make_engine(num_kv_blocks=20, session_swap_dir=str(tmp_path / "tier"))
    # Two requests of 9 blocks each grow past the 20-block pool: the newer one is preempted, parked, resumed.
    for i in range(2):
        engine.add_request(EngineRequest(f"r{i}", prompt(130, start=1000 + 500 * i), SamplingOptions(max_tokens=60)))
    done = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert done == {"r0": "length", "r1": "length"}
    assert engine.stats().num_preemptions >= 1
    assert engine.sessions.swap_outs >= 1 and engine.sessions.swap_ins >= 1
    assert engine.sessions.tier.num_entries == 0 and engine.take_session_events() == []
    engine.check_no_leak()


def test_under_pressure_an_idle_session_is_reclaimed_before_one_whose_next_turn_is_waiting(make_engine):
    engine = make_engine(num_kv_blocks=40)
    out_a, _ = turn(engine, "a1", prompt(100), session="a")  # kept first: the least recently used
    turn(engine, "b1", prompt(100, start=4000), session="b")
    engine.take_session_events()
    # a's next turn waits behind a request that needs the room of one of the two sessions
    engine.add_request(EngineRequest("big", prompt(28 * BS + 1, start=9000), SamplingOptions(max_tokens=2)))  # 29 of 28
    engine.add_request(EngineRequest("a2", prompt(100) + out_a + [7], SamplingOptions(max_tokens=2), session_id="a"))
    ends = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                ends[o.request_id] = o
    assert [e.session for e in engine.take_session_events()] == ["b"]  # b went, a's waiting turn found its own
    assert ends["a2"].num_cached_tokens == 6 * BS


def test_a_swapped_turn_waits_for_room_to_swap_in_rather_than_recompute_in_chunks(make_engine, tmp_path):
    # The worker's shape: a prefill chunk (here 2 blocks) is far smaller than a conversation's KV (6 blocks). First
    # tokens first is off: the turn waits (with it on, it preempts "long": the test after the policy's below).
    engine = swap_engine(
        make_engine, tmp_path, max_num_batched_tokens=2 * BS, max_num_seqs=4, first_token_preempt_min_tokens=0
    )
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session="a")
    squeeze(engine)
    engine.take_session_events()
    # A long request holds all but 5 blocks while a's next turn arrives: room for a chunk, not for a's 6 blocks.
    engine.add_request(EngineRequest("long", prompt(26 * BS, start=9000), SamplingOptions(max_tokens=20)))
    engine.step()
    while engine.scheduler.running[0].num_computed_tokens < 26 * BS:
        engine.step()
    engine.add_request(EngineRequest("a2", convo + out + [7], SamplingOptions(max_tokens=2), session_id="a"))
    ends = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                ends[o.request_id] = o
    assert ends["a2"].num_cached_tokens == 6 * BS  # swapped back in once "long" ended, not recomputed
    assert engine.sessions.swap_ins == 1 and engine.stats().num_preemptions == 0


def run_all(engine: LLMEngine, *add_later: tuple[int, EngineRequest]) -> tuple[dict, list]:
    """Step the engine until every request ended; each of `add_later` = (after how many outputs of the requests
    together, the request to add then). -> ({request id: its output tokens}, [(request id, finished, its tokens so
    far) per output, in the order the engine gave them])."""
    tokens: dict[str, list[int]] = {}
    order, emitted, later = [], 0, sorted(add_later, key=lambda x: x[0])
    while engine.has_unfinished() or later:
        while later and emitted >= later[0][0]:
            engine.add_request(later.pop(0)[1])
        for o in engine.step().outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            emitted += len(o.new_token_ids)
            order.append((o.request_id, o.finished, len(tokens[o.request_id])))
    return tokens, order


def first_of(order: list, rid: str) -> int:
    return next(i for i, (r, _, _) in enumerate(order) if r == rid)


def end_of(order: list, rid: str) -> int:
    return next(i for i, (r, finished, _) in enumerate(order) if r == rid and finished)


def greedy(rid: str, tokens: list[int], max_tokens: int, session: str = "") -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingOptions(temperature=0.0, max_tokens=max_tokens), session_id=session)


def first_token_engine(make_engine, tmp_path, least: int) -> LLMEngine:
    return make_engine(
        num_kv_blocks=20, session_swap_dir=str(tmp_path / "tier"), max_num_seqs=4, first_token_preempt_min_tokens=least
    )


def test_a_request_with_no_token_yet_preempts_one_that_has_had_its_share_and_both_answers_are_unchanged(
    make_engine, tmp_path
):
    alone = {}
    for rid, p in (("long", prompt(200)), ("new", prompt(120, start=5000))):
        engine = first_token_engine(make_engine, tmp_path / rid, least=8)
        engine.add_request(greedy(rid, p, 40))
        alone[rid] = run_all(engine)[0][rid]
    # "long" holds 14 of the 20 blocks and has emitted 10 tokens when "new" (8 blocks) arrives.
    engine = first_token_engine(make_engine, tmp_path / "both", least=8)
    engine.add_request(greedy("long", prompt(200), 40))
    tokens, order = run_all(engine, (10, greedy("new", prompt(120, start=5000), 40)))
    assert tokens == alone
    assert first_of(order, "new") < end_of(order, "long"), "new got its first token before long's answer ended"
    assert engine.stats().num_preemptions == 1
    assert engine.sessions.swap_outs == 1 and engine.sessions.swap_ins == 1  # long's KV parked, not recomputed
    engine.check_no_leak()


def test_a_running_request_that_has_not_had_its_share_since_admission_is_not_preempted_for_a_first_token(
    make_engine, tmp_path
):
    engine = first_token_engine(make_engine, tmp_path, least=30)
    engine.add_request(greedy("long", prompt(200), 40))
    _, order = run_all(engine, (10, greedy("new", prompt(120, start=5000), 40)))
    long_before = max(n for rid, _, n in order[: first_of(order, "new")] if rid == "long")
    assert long_before >= 30, "long emitted its 30 tokens before anyone could take its place"
    assert engine.stats().num_preemptions == 1


def test_with_the_minimum_at_zero_a_first_token_waits_for_the_running_answer_to_end(make_engine, tmp_path):
    engine = first_token_engine(make_engine, tmp_path, least=0)
    engine.add_request(greedy("long", prompt(200), 40))
    _, order = run_all(engine, (10, greedy("new", prompt(120, start=5000), 40)))
    assert end_of(order, "long") < first_of(order, "new") and engine.stats().num_preemptions == 0


def test_a_swapped_session_turn_preempts_a_running_request_that_has_had_its_share_and_swaps_its_kv_in(
    make_engine, tmp_path
):
    engine = swap_engine(make_engine, tmp_path, max_num_seqs=4, first_token_preempt_min_tokens=8)
    convo = prompt(100)
    out, _ = turn(engine, "a1", convo, session="a")
    squeeze(engine)
    engine.take_session_events()
    # "long" holds 27 of the 32 blocks: a's next turn needs its 6 swapped blocks back, and finds 5.
    engine.add_request(greedy("long", prompt(26 * BS, start=9000), 40))
    tokens, order = run_all(engine, (10, greedy("a2", convo + out + [7], 2, session="a")))
    assert end_of(order, "a2") < end_of(order, "long")
    assert len(tokens["long"]) == 40 and engine.stats().num_preemptions == 1
    assert engine.sessions.swap_ins == 2  # a's conversation, then long's parked KV


def test_a_first_token_is_not_held_behind_a_preempted_request_waiting_for_room_to_resume(make_engine, tmp_path):
    engine = first_token_engine(make_engine, tmp_path, least=8)
    engine.add_request(greedy("long", prompt(200), 40))
    # new1 preempts long (14 blocks), which then waits at the head of the queue for the room to swap back in;
    # new2 comes in behind it while new1 runs and fits in what is free: it starts rather than wait behind long.
    _, order = run_all(
        engine,
        (10, greedy("new1", prompt(120, start=5000), 40)),
        (30, greedy("new2", prompt(120, start=7000), 40)),
    )
    assert first_of(order, "new2") < end_of(order, "new1")
    assert engine.stats().num_preemptions == 1
    engine.check_no_leak()
