"""Placement of the choices of one n > 1 request (services/scheduler/affinity.py through the Router): pure, no Redis."""

from __future__ import annotations

import time

from services.scheduler.affinity import GroupAffinity
from services.scheduler.routing import Router
from services.scheduler.state import RequestQueue, WorkerView
from shared.wire.events import Preprocessed, Sampling
from shared.settings import SchedulerSettings
from tests.support.scheduling import heartbeat

PROMPT = tuple(range(1, 50))  # 49 tokens: 3 full blocks of 16 and a partial one


def _workers(*ids: str) -> list[WorkerView]:
    return [WorkerView(w, heartbeat(w), time.monotonic()) for w in ids]


def _choices(group: str, n: int):
    q = RequestQueue()
    for i in range(n):
        q.push(
            Preprocessed(
                request_id=f"{group}-{i}",
                reply_to="r",
                prompt_token_ids=PROMPT,
                sampling=Sampling(max_tokens=4),
                priority=0,
                deadline=time.time() + 60,
                received_at=time.time() + i,
                group_id=group if n > 1 else "",
                group_size=n,
            )
        )
    return [q.pop() for _ in range(n)]


def test_the_choices_of_one_request_go_where_the_first_went():
    router, fits = Router(SchedulerSettings()), _workers("a", "b")
    alone = [router.choose(q, fits, 4, 16).worker_id for q in _choices("x", 1) + _choices("y", 1)]
    assert len(set(alone)) == 2  # the control: equal workers take turns
    decisions = [router.choose(q, fits, 4, 16) for q in _choices("g", 4)]
    assert len({d.worker_id for d in decisions}) == 1
    assert [d.reason for d in decisions[1:]] == ["group"] * 3
    assert decisions[1].new_blocks(4) == 1  # its 3 full prompt blocks are its sibling's: only the last is its own


def test_a_group_is_forgotten_once_all_its_choices_are_placed():
    router, fits = Router(SchedulerSettings()), _workers("a", "b")
    for q in _choices("g", 3):
        router.choose(q, fits, 4, 16)
    assert len(router.groups) == 0


def test_a_choice_whose_groups_worker_has_no_slot_is_placed_as_any_request():
    router, (a, b) = Router(SchedulerSettings()), _workers("a", "b")
    first, second = _choices("g", 2)
    chosen = router.choose(first, [a, b], 4, 16).worker_id
    other = b if chosen == "a" else a
    d = router.choose(second, [other], 4, 16)
    assert d.worker_id == other.worker_id and d.reason != "group"


def test_the_table_of_groups_is_bounded_oldest_first():
    groups = GroupAffinity(max_groups=2)
    for g in ("g1", "g2", "g3"):
        groups.placed(g, 4, "a")
    assert len(groups) == 2 and groups.worker_for("g1") is None and groups.worker_for("g3") == "a"


def test_a_lost_workers_groups_are_forgotten():
    groups = GroupAffinity()
    groups.placed("g1", 4, "a")
    groups.placed("g2", 4, "b")
    groups.drop_worker("a")
    assert groups.worker_for("g1") is None and groups.worker_for("g2") == "b"
