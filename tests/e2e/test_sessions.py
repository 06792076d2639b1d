"""Conversation sessions through the whole pipeline (real gateway, tokenizer, scheduler, Redis; two simulated
workers): X-Session-ID ties turns together, the session is PAUSED between turns on the worker that kept its KV,
the next turn goes there and reuses it, limits and ownership answer with clear 4xx, DELETE releases the KV."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.cluster import KEY_A, KEY_B, auth, cluster_fixture
from tests.support.openai_fixtures import MODEL
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

BS = 16
KEY_C = "key-gamma-1357924680"  # this module's own: its sessions are counted against the limit alone
LIMIT = 16
cluster = cluster_fixture(
    "sessions",
    workers=2,
    env={**SIM, "CONVEYOR_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}", "CONVEYOR_MAX_SESSIONS_PER_KEY": str(LIMIT)},
)


def chat(cluster, messages, session=None, key=KEY_A, **extra):
    headers = {**auth(key), **({"X-Session-ID": session} if session else {})}
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def session(cluster, sid, key=KEY_A):
    return httpx.get(f"{cluster.url}/v1/sessions/{sid}", headers=auth(key), timeout=10)


def placed_on(cluster, rid: str) -> dict:
    return httpx.get(f"{cluster.url}/v1/requests/{rid}", headers=auth(KEY_A), timeout=10).json()["exec"]


def test_a_turn_leaves_its_session_paused_on_the_worker_that_kept_its_kv(cluster):
    r = chat(cluster, [{"role": "user", "content": "Tell me about the sea " * 8}], session="paused-1")
    assert r.status_code == 200, r.text
    s = session(cluster, "paused-1").json()
    assert s["state"] == "PAUSED" and s["turns"] == 1 and s["kv_tier"] == "memory"
    assert s["kv_blocks"] >= r.json()["usage"]["prompt_tokens"] // BS
    assert s["worker_id"] == placed_on(cluster, r.headers["X-Request-Id"])["worker_id"]
    wait_for(lambda: _metric(cluster, "conveyor:num_sessions_paused") >= 1, 15, what="the metric of paused sessions")


def test_the_next_turn_goes_to_that_worker_and_prefills_only_what_it_adds(cluster):
    turn1 = [{"role": "user", "content": "Name three rivers of Europe, please " * 6}]
    first = chat(cluster, turn1, session="resume-1").json()
    answer = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Asia?"}]
    second = chat(cluster, turn2, session="resume-1")
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // BS * BS
    exec1 = placed_on(cluster, first["id"].removeprefix("chatcmpl-"))
    exec2 = placed_on(cluster, second.headers["X-Request-Id"])
    assert exec2["worker_id"] == exec1["worker_id"] and exec2["routing_reason"] == "session"
    assert session(cluster, "resume-1").json()["turns"] == 2


def test_a_turn_while_another_of_its_session_runs_is_a_409_naming_the_session(cluster):
    headers = {**auth(KEY_A), "X-Session-ID": "busy-1"}
    body = {"model": MODEL, "prompt": "Count slowly", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the turn is running
        second = chat(cluster, [{"role": "user", "content": "hi"}], session="busy-1")
        assert second.status_code == 409
        assert second.json()["error"]["param"] == "session_id"
        assert second.json()["error"]["code"] == "session_busy"
    # the first stream was closed early: its turn ends (cancelled) and the session takes turns again
    wait_for(lambda: session(cluster, "busy-1").json()["state"] != "RUNNING", 30, what="the turn's end")
    assert chat(cluster, [{"role": "user", "content": "hi"}], session="busy-1").status_code == 200


def test_the_correlation_id_header_and_the_body_field_name_a_session_too(cluster):
    headers = {**auth(KEY_A), "X-Correlation-ID": "corr-1"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert httpx.post(f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    assert session(cluster, "corr-1").json()["turns"] == 1
    native = {"prompt": "hello there", "max_tokens": 4, "session_id": "body-1"}
    assert httpx.post(f"{cluster.url}/generate", json=native, headers=auth(KEY_A), timeout=60).status_code == 200
    assert session(cluster, "body-1").json()["turns"] == 1


def test_another_key_cannot_see_or_close_a_session(cluster):
    chat(cluster, [{"role": "user", "content": "mine"}], session="owned-1")
    assert session(cluster, "owned-1", key=KEY_B).status_code == 404
    gone = httpx.delete(f"{cluster.url}/v1/sessions/owned-1", headers=auth(KEY_B), timeout=10)
    assert gone.status_code == 404
    assert session(cluster, "owned-1").json()["turns"] == 1


def test_a_malformed_session_id_is_a_400_naming_the_header(cluster):
    r = chat(cluster, [{"role": "user", "content": "x"}], session="no spaces/allowed")
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"


def test_a_session_with_n_above_one_is_a_400_naming_n(cluster):
    r = chat(cluster, [{"role": "user", "content": "x"}], session="n-1", n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_deleting_a_session_releases_the_kv_its_worker_kept(cluster):
    chat(cluster, [{"role": "user", "content": "keep this conversation " * 10}], session="del-1", key=KEY_B)
    before = paused_sessions_seen_after(cluster, time.time())
    r = httpx.delete(f"{cluster.url}/v1/sessions/del-1", headers=auth(KEY_B), timeout=10)
    assert r.status_code == 200 and r.json() == {"id": "del-1", "object": "session.deleted", "deleted": True}
    assert session(cluster, "del-1", key=KEY_B).status_code == 404
    wait_for(lambda: paused_sessions_seen_after(cluster, time.time()) == before - 1, 15, what="the KV released")


def paused_sessions_seen_after(cluster, t: float) -> int:
    """Paused sessions over the workers, from heartbeats sent after t (each worker's liveness entry)."""

    def beats():
        raw = cluster.client().hgetall(cluster.names.live_hash("worker"))
        entries = [json.loads(v) for v in raw.values()]
        return entries if len(entries) == 2 and all(e["at"] > t for e in entries) else None

    return sum(e["sessions_paused"] for e in wait_for(beats, 15, what="heartbeats after the change"))


def test_a_key_past_its_session_limit_gets_a_429_naming_the_limit(cluster):
    for i in range(LIMIT):
        made = httpx.post(f"{cluster.url}/v1/sessions", json={"session_id": f"lim-{i}"}, headers=auth(KEY_C))
        assert made.status_code == 201
    r = chat(cluster, [{"role": "user", "content": "x"}], session="lim-x", key=KEY_C)
    assert r.status_code == 429 and f"max_sessions_per_key={LIMIT}" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "session_id"
    assert session(cluster, "lim-x", key=KEY_C).status_code == 404
    httpx.delete(f"{cluster.url}/v1/sessions/lim-0", headers=auth(KEY_C), timeout=10)  # a closed one frees its place
    assert chat(cluster, [{"role": "user", "content": "x"}], session="lim-x", key=KEY_C).status_code == 200


def test_opening_a_session_gives_it_an_id_and_an_existing_id_is_a_409(cluster):
    made = httpx.post(f"{cluster.url}/v1/sessions", headers=auth(KEY_A), timeout=10)
    assert made.status_code == 201 and made.json()["state"] == "OPEN" and made.json()["turns"] == 0
    again = httpx.post(f"{cluster.url}/v1/sessions", json={"session_id": made.json()["id"]}, headers=auth(KEY_A))
    assert again.status_code == 409


def test_a_request_without_a_session_makes_no_session(cluster):
    def ids():
        return sorted(s["id"] for s in httpx.get(f"{cluster.url}/v1/sessions", headers=auth(KEY_A)).json()["data"])

    before = ids()
    assert chat(cluster, [{"role": "user", "content": "plain"}]).status_code == 200
    assert ids() == before


def test_metrics_count_the_workers_kv_swaps_out_and_in(cluster):
    assert _metric(cluster, "conveyor:kv_swap_outs_total") >= _metric(cluster, "conveyor:kv_swap_ins_total") >= 0


def _metric(cluster, name: str) -> float:
    text = httpx.get(f"{cluster.url}/metrics", headers=auth(KEY_A), timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    pytest.fail(f"{name} not in /metrics")
