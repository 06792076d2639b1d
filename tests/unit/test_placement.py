"""The placement policy alone (services/scheduler/placement.py): pure, no Redis, no model."""

from __future__ import annotations

import pytest

from services.scheduler.placement import Candidate, Placement


def cand(
    wid: str, matched: int = 0, used: int = 0, requests: int = 0, free: int = 1000, total: int = 1000
) -> Candidate:
    return Candidate(wid, matched, used, free, total, requests)


def test_kv_sends_a_request_to_the_worker_holding_its_prefix():
    d = Placement("kv").choose(
        66,
        67,
        [
            cand("a", used=20, requests=2),
            cand("b", matched=64, used=30, requests=3),
            cand("c", matched=10, used=20, requests=2),
        ],
    )
    assert d.worker_id == "b" and d.reason == "overlap"
    assert d.matched == {"a": 0, "b": 64, "c": 10}
    assert d.costs["b"] == 4 * 2 + 30 and d.costs["a"] == 4 * 66 + 20


def test_kv_cost_weighs_uncached_blocks_against_decode_load():
    cands = [cand("a", matched=8, used=100), cand("b", used=0)]
    assert Placement("kv", overlap_weight=1.0).choose(16, 17, cands).worker_id == "b"  # 8 + 100 > 16 + 0
    assert Placement("kv", overlap_weight=20.0).choose(16, 17, cands).worker_id == "a"  # 160 + 100 < 320 + 0


def test_load_guard_overrides_the_prefix_when_workers_are_imbalanced():
    p = Placement("kv", balance_abs=4, balance_rel=1.5)
    busy, idle = cand("a", matched=64, used=40, requests=10, free=900), cand("b", used=5, requests=1, free=990)
    d = p.choose(66, 67, [busy, idle])
    assert d.worker_id == "b" and d.reason == "load_guard"
    # Within the thresholds the prefix still wins.
    d = p.choose(66, 67, [cand("a", matched=64, used=40, requests=4, free=900), idle])
    assert d.worker_id == "a" and d.reason == "overlap"


def test_ties_are_spread_over_the_workers_in_turn():
    p = Placement("kv")
    workers = [cand(w) for w in ("a", "b", "c", "d")]
    chosen = [p.choose(4, 5, workers).worker_id for _ in range(8)]
    assert chosen == ["a", "b", "c", "d", "a", "b", "c", "d"]


def test_a_tie_goes_to_the_worker_holding_fewer_requests():
    d = Placement("kv").choose(4, 5, [cand("a", requests=3), cand("b", requests=1), cand("c", requests=2)])
    assert d.worker_id == "b"


def test_a_worker_without_room_for_the_uncached_blocks_is_passed_over():
    d = Placement("kv").choose(66, 67, [cand("a", matched=64, free=2), cand("b", used=500, free=500)])
    assert d.worker_id == "b"
    # Its cached blocks need no room: 3 new blocks fit in 3 free ones.
    assert Placement("kv").choose(66, 67, [cand("a", matched=64, free=3), cand("b", free=500)]).worker_id == "a"


def test_load_mode_ignores_the_prefix_and_takes_the_emptiest_pool():
    d = Placement("load").choose(66, 67, [cand("a", matched=64, free=400), cand("b", free=900)])
    assert d.worker_id == "b" and d.reason == "load" and d.matched["a"] == 64


def test_round_robin_takes_each_worker_in_turn_whatever_it_holds():
    p = Placement("round_robin")
    workers = [cand("b", matched=60), cand("a"), cand("c", requests=9)]
    assert [p.choose(64, 65, workers).worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_new_blocks_are_the_needed_ones_minus_those_cached_on_the_chosen_worker():
    d = Placement("kv").choose(66, 67, [cand("a", matched=64)])
    assert d.new_blocks(67) == 3


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="routing mode"):
        Placement("random")


def test_the_routing_setting_is_kv_by_default_and_refuses_unknown_modes(monkeypatch):
    from pydantic import ValidationError

    from shared.settings import SchedulerSettings

    monkeypatch.delenv("CONVEYOR_ROUTING", raising=False)
    assert SchedulerSettings().routing == "kv"
    monkeypatch.setenv("CONVEYOR_ROUTING", "round_robin")
    assert SchedulerSettings().routing == "round_robin"
    monkeypatch.setenv("CONVEYOR_ROUTING", "random")
    with pytest.raises(ValidationError, match="routing"):
        SchedulerSettings()
    monkeypatch.setenv("CONVEYOR_ROUTING", "kv")
    monkeypatch.setenv("CONVEYOR_ROUTING_BALANCE_REL", "0.5")
    with pytest.raises(ValidationError, match="routing_balance_rel"):
        SchedulerSettings()
