"""Conversation sessions when processes die (simulated workers; each test its own cluster), in phases as Dynamo's
fault tests: a baseline turn, the fault, then the recovery turn, which must succeed (recomputing, never an error)."""

from __future__ import annotations

import os
import signal

import httpx

from shared.redis_io.redis_server import free_port
from tests.support.openai_fixtures import MODEL
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

FAST = {"CONVEYOR_LIVENESS_TTL_S": "3", "CONVEYOR_HEARTBEAT_INTERVAL_S": "0.5", "CONVEYOR_CLAIM_IDLE_MS": "1000"}
QUESTION = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper " * 6}]


def turn(url: str, session: str, messages=QUESTION, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": session}, timeout=90)


def follow_up(first: httpx.Response) -> list[dict]:
    answer = first.json()["choices"][0]["message"]["content"]
    return QUESTION + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]


def session(url: str, sid: str) -> dict:
    return httpx.get(f"{url}/v1/sessions/{sid}", timeout=10).json()


def test_a_worker_killed_with_paused_sessions_their_next_turns_recompute_on_another(start_cluster):
    c = start_cluster(workers=2, env={**FAST, **SIM})
    firsts = {f"s{i}": turn(c.url, f"s{i}") for i in range(4)}  # baseline: each PAUSED on a worker
    holders = {sid: session(c.url, sid)["worker_id"] for sid in firsts}
    assert all(holders.values())
    victim = next(iter(holders.values()))
    name = next(n for n, p in c.procs.items() if n.startswith("worker") and f"-{p.pid}-" in victim)
    os.kill(c.procs[name].pid, signal.SIGKILL)
    wait_for(lambda: _workers_alive(c) == 1, 30, what="the killed worker noticed")
    for sid, first in firsts.items():  # recovery: every next turn answers
        r = turn(c.url, sid, follow_up(first))
        assert r.status_code == 200, r.text
        if holders[sid] == victim:
            assert session(c.url, sid)["worker_id"] != victim


def _workers_alive(c) -> int:
    return httpx.get(f"{c.url}/ready", timeout=5).json()["live"]["worker"]


def test_a_gateway_killed_mid_turn_leaves_its_session_to_the_next_turn_on_another_gateway(start_cluster):
    c = start_cluster(env={**FAST, **SIM})
    port = free_port()
    c.start_service("gateway2", {"CONVEYOR_PORT": str(port)})
    other = f"http://127.0.0.1:{port}"
    wait_for(lambda: _ready(other), 120, what="second gateway")
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{c.url}/v1/completions", json=body, headers={"X-Session-ID": "g1"}, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)  # the turn runs
        assert session(other, "g1")["state"] == "RUNNING"
        os.kill(c.procs["gateway"].pid, signal.SIGKILL)  # the fault: nobody will end this turn
    # recovery: the orphaned turn is cancelled by the scheduler; the next turn takes the session over
    r = wait_for(lambda: (x := turn(other, "g1")).status_code == 200 and x, 60, what="the next turn accepted")
    assert r.json()["choices"][0]["finish_reason"] == "length"
    s = session(other, "g1")
    assert s["turns"] == 2 and s["state"] == "PAUSED"


def test_a_gateway_and_scheduler_restart_loses_no_session(start_cluster):
    c = start_cluster(env={**FAST, **SIM})
    first = turn(c.url, "r1")
    before = session(c.url, "r1")
    for name in ("gateway", "scheduler"):  # the fault: both stop and start again
        c.procs[name].send_signal(signal.SIGTERM)
        c.procs[name].wait(60)
        c.start_service(name)
    c.wait_ready(120)
    assert session(c.url, "r1")["state"] == "PAUSED" and session(c.url, "r1")["worker_id"] == before["worker_id"]
    second = turn(c.url, "r1", follow_up(first))
    assert second.status_code == 200
    prompt = first.json()["usage"]["prompt_tokens"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt // 16 * 16


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
