"""n > 1 choices at the edges: a request whose choices do not all fit the waiting bound is refused whole, and
choices whose worker dies are moved and still complete (simulated workers, real everything else)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import defaultdict

import httpx
import openai
import pytest
import redis

from shared.wire.constants import Names
from shared.process.liveness import read_live
from tests.support.openai_fixtures import MODEL, openai_client, request_id
from tests.support.waiting import wait_for

N = 4
FAST = {"CONVEYOR_LIVENESS_TTL_S": "3", "CONVEYOR_HEARTBEAT_INTERVAL_S": "0.5", "CONVEYOR_CLAIM_IDLE_MS": "1000"}


@pytest.fixture(scope="module", autouse=True)
def sim_workers():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_ENGINE", "sim")
        yield


def _meta(r, ns: str, rid: str) -> dict:
    return {k.decode(): v.decode() for k, v in r.hgetall(Names(ns).layer(rid, "meta")).items()}


def _running(r, ns: str) -> bool:
    return any(w["running"] >= 1 for w in read_live(r, Names(ns), "worker").values())


def test_choices_beyond_the_waiting_bound_refuse_the_request_whole(start_cluster):
    """One sequence slot, held by a blocker; a waiting bound of 2: choices 0 and 1 are created, choice 2 is refused,
    so the request gets 429 and the two created are cancelled, not left to run for nobody."""
    env = {"CONVEYOR_MAX_NUM_SEQS": "1", "CONVEYOR_QUEUE_SLACK": "0", "CONVEYOR_MAX_WAITING_REQUESTS": "2"}
    c = start_cluster(env=env)
    client, r = openai_client(c.url), redis.Redis.from_url(c.redis.url)
    outcome: list = []

    def block() -> None:  # cancelled at the end (499)
        try:
            client.completions.create(
                model=MODEL, prompt="Count:", max_tokens=4000, extra_body={"ignore_eos": True, "timeout": 120}
            )
        except openai.APIStatusError as e:
            outcome.append(e.status_code)

    blocker = threading.Thread(target=block)
    blocker.start()
    wait_for(lambda: _running(r, c.ns), 60, what="the blocker is running")
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="Hello", n=N, max_tokens=2)
    assert e.value.code == "overloaded"
    created = [rid.decode() for rid in r.zrange(Names(c.ns).requests_index(0), 0, -1)]
    choices = [rid for rid in created if _meta(r, c.ns, rid).get("n") == str(N)]
    assert len(choices) == 2
    wait_for(
        lambda: all(_meta(r, c.ns, rid)["state"] == "CANCELLED" for rid in choices),
        30,
        what="the created choices cancelled",
    )
    assert {_meta(r, c.ns, rid)["reason"] for rid in choices} == {"choice_failed"}
    for rid in created:
        if rid not in choices:
            httpx.delete(f"{c.url}/v1/requests/{rid}", timeout=10)  # the blocker: no need to wait for it
    blocker.join(60)
    assert outcome == [499]


def _stream_texts(stream, on_progress) -> tuple[str, dict[int, str], dict[int, str]]:
    texts, finishes, rid, called = defaultdict(str), {}, "", False
    for chunk in stream:
        rid = request_id(chunk.id)
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason is not None:
                finishes[ch.index] = ch.finish_reason
        if not called and len(texts) == N and all(len(t) > 8 for t in texts.values()):
            called = True
            on_progress(rid)
    return rid, dict(texts), finishes


def test_choices_whose_worker_dies_are_moved_and_complete_with_their_own_tokens(start_cluster):
    c = start_cluster(workers=2, env=FAST)
    client, r = openai_client(c.url), redis.Redis.from_url(c.redis.url)
    wait_for(lambda: len(read_live(r, Names(c.ns), "worker")) == 2, 30, what="two workers")
    ask = {
        "model": MODEL,
        "prompt": "Once upon a time " * 8,
        "n": N,
        "max_tokens": 96,
        "seed": 9,
        "extra_body": {"ignore_eos": True},
    }
    victims = []

    def kill_their_worker(rid: str) -> None:
        worker = json.loads(r.hget(Names(c.ns).layer(rid, "exec"), "worker_id"))
        victim = next(p for p in c.procs.values() if f"-{p.pid}-" in worker)
        victims.append(victim)
        os.kill(victim.pid, signal.SIGKILL)

    rid, texts, finishes = _stream_texts(client.completions.create(stream=True, **ask), kill_their_worker)
    assert victims, "the choices never all produced output"
    assert finishes == {i: "length" for i in range(N)}
    ids = json.loads(_meta(r, c.ns, rid)["group_members"])
    moved = [i for i in ids if b"worker_lost" in b"".join(r.lrange(Names(c.ns).history(i), 0, -1))]
    assert moved, "no choice was moved"
    again = client.completions.create(**ask)  # on the surviving worker, undisturbed
    assert texts == {ch.index: ch.text for ch in again.choices}
