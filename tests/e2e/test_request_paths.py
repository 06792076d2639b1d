"""Every path of a request's life, on a cluster with one single-slot worker (so requests queue).

Each test asserts the final state, the client's answer, the history, and that the worker holds
no KV block afterwards. The paths are the control plane's: the worker runs the simulated engine
(CONVEYOR_ENGINE=sim), whose steps report modelled costs as the real engine's report measured ones.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import redis

from shared.wire.constants import Names
from shared.process.liveness import read_live
from tests.support.cluster import cluster_fixture
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

LONG = {
    "prompt": "Count from one to a thousand:",
    "max_tokens": 3000,
    "temperature": 0,
    "ignore_eos": True,
    "timeout": 600,
}


single = cluster_fixture(
    "single",
    env={**SIM, "CONVEYOR_MAX_NUM_SEQS": "1", "CONVEYOR_QUEUE_SLACK": "0", "CONVEYOR_MAX_NUM_BATCHED_TOKENS": "32"},
)


def snap(c, rid: str) -> dict:
    return httpx.get(f"{c.url}/v1/requests/{rid}", timeout=10).json()


def states(c, rid: str) -> list[str]:
    return [h["state"] for h in snap(c, rid)["history"]]


def worker_idle(c) -> bool:
    r = redis.Redis.from_url(c.redis.url)
    infos = list(read_live(r, Names(c.ns), "worker").values())
    return bool(infos) and all(i["held"] == 0 and i["free_blocks"] == i["total_blocks"] for i in infos)


class Background:
    """A request sent from a thread; .rid once its id is known, .response at the end."""

    def __init__(self, c, body: dict):
        self.c, self.body, self.rid, self.response = c, body, None, None
        self.events: list[dict] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        with httpx.stream("POST", f"{self.c.url}/generate", json={**self.body, "stream": True}, timeout=600) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    self.rid = ev.get("request_id", self.rid)
                    self.events.append(ev)

    def wait_state(self, state: str, timeout: float = 60):
        wait_for(lambda: self.rid_from_listing(), timeout, what="request id")
        wait_for(lambda: snap(self.c, self.rid)["state"] == state, timeout, what=f"state {state}")

    def rid_from_listing(self):
        if self.rid is None:
            # A streaming request shows its id with its first token; before that, find it by listing.
            data = httpx.get(f"{self.c.url}/v1/requests", timeout=10).json()["data"]
            mine = [d for d in data if d["input"].get("prompt") == self.body["prompt"]]
            if len(mine) == 1:
                self.rid = mine[0]["request_id"]
        return self.rid

    def join(self):
        self.thread.join(120)
        return self.events[-1] if self.events else None


def occupy(c) -> Background:
    """Fill the only slot with a long request."""
    b = Background(c, {**LONG, "prompt": f"Occupy {os.urandom(4).hex()}:"})
    b.wait_state("DECODING")
    return b


def release(c, b: Background) -> None:
    httpx.delete(f"{c.url}/v1/requests/{b.rid}", timeout=10)
    b.join()
    wait_for(lambda: worker_idle(c), 30, what="worker idle")


def test_a_request_that_cannot_start_before_its_timeout_is_refused_from_the_queue(single):
    """Behind a 3,000-token request holding the only slot, a 2 s timeout cannot be met: the scheduler refuses it
    (on arrival, or at its next judgement a second later) with 429 and Retry-After, not a 504 when the 2 s pass.
    The scheduler's own QUEUED -> TIMED_OUT (a prediction proven wrong) is tests/test_deadlines.py's."""
    hog = occupy(single)
    try:
        r = httpx.post(
            f"{single.url}/generate", json={"prompt": "Wait in line", "max_tokens": 5, "timeout": 2}, timeout=60
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
        assert int(r.headers["retry-after"]) >= 1
        hist = snap(single, r.headers["x-request-id"])["history"]
        assert [h["state"] for h in hist][-2:] == ["QUEUED", "FAILED"] and hist[-1]["service"] == "scheduler"
    finally:
        release(single, hog)


def test_timeout_while_decoding_returns_partial_and_frees_blocks(single):
    r = httpx.post(f"{single.url}/generate", json={**LONG, "timeout": 4}, timeout=60)
    assert r.status_code == 504
    partial = r.json()["error"]["partial"]
    assert partial["token_ids"] and partial["text"]
    rid = r.headers["x-request-id"]
    hist = snap(single, rid)["history"]
    assert hist[-1]["state"] == "TIMED_OUT" and hist[-1]["from"] == "DECODING" and hist[-1]["service"] == "worker"
    wait_for(lambda: worker_idle(single), 30, what="worker idle")


def test_cancel_while_queued_never_starts(single):
    hog = occupy(single)
    b = Background(single, {"prompt": "Queued then cancelled", "max_tokens": 5})
    b.wait_state("QUEUED")
    r = httpx.delete(f"{single.url}/v1/requests/{b.rid}", timeout=10).json()
    assert r["cancelled"] is True and r["state"] == "CANCELLED"
    final = b.join()
    assert final["finish_reason"] == "cancelled"
    release(single, hog)
    assert "SCHEDULED" not in states(single, b.rid)


def test_cancel_while_prefilling_frees_blocks(single):
    b = Background(single, {"prompt": "word " * 3000, "max_tokens": 5, "timeout": 600})
    b.wait_state("PREFILLING")
    assert httpx.delete(f"{single.url}/v1/requests/{b.rid}", timeout=10).json()["cancelled"] is True
    assert b.join()["finish_reason"] == "cancelled"
    assert states(single, b.rid)[-2:] == ["PREFILLING", "CANCELLED"]
    wait_for(lambda: worker_idle(single), 30, what="worker idle")


def test_cancel_before_tokenizer_wins_and_request_never_starts(single):
    tok = single.procs["tokenizer"]
    os.kill(tok.pid, signal.SIGSTOP)
    try:
        b = Background(single, {"prompt": "Never tokenized", "max_tokens": 5})
        b.wait_state("RECEIVED")
        assert httpx.delete(f"{single.url}/v1/requests/{b.rid}", timeout=10).json()["cancelled"] is True
    finally:
        os.kill(tok.pid, signal.SIGCONT)
    assert b.join()["finish_reason"] == "cancelled"
    # The tokenizer now reads the request and is refused: it never moves on.
    r = redis.Redis.from_url(single.redis.url)
    wait_for(lambda: r.xpending(Names(single.ns).received_stream(0), "tokenizer")["pending"] == 0, 30, what="acked")
    assert states(single, b.rid) == ["RECEIVED", "CANCELLED"]


def test_two_cancels_at_once_settle_once(single):
    hog = occupy(single)
    results: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(httpx.delete(f"{single.url}/v1/requests/{hog.rid}", timeout=10).json())
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["cancelled"] for r in results) == [False, True]
    hog.join()
    assert states(single, hog.rid).count("CANCELLED") == 1
    wait_for(lambda: worker_idle(single), 30, what="worker idle")


def test_request_without_timeout_gets_an_adaptive_deadline(single):
    out = httpx.post(f"{single.url}/generate", json={"prompt": "Adaptive", "max_tokens": 4}, timeout=60).json()
    meta = snap(single, out["request_id"])["meta"]
    assert meta["deadline_source"] == "adaptive" and meta["predicted_s"] > 0
    budget = meta["deadline"] - meta["created_at"]
    expected = min(max(1.5 * meta["predicted_s"], 120.0), 300.0)  # the cluster's floor is 120 s
    assert abs(budget - expected) < 1.0


def test_adaptive_deadline_counts_the_work_queued_ahead(single):
    hog = occupy(single)
    # 200 tokens queued, not 2,000: both come without a timeout (an adaptive deadline is priced only then), so the
    # short one is refused (429) if its wait to start (what is queued ahead plus the hog's ~3,000 steps left) is
    # priced past the 300 s default; the simulated steps over the hog's long context cost ~62 ms, and 5,000 of them
    # were (2026-12-07); 3,200 need 94 ms a step to be.
    first = Background(single, {"prompt": "Long one queued", "max_tokens": 200, "ignore_eos": True})
    first.wait_state("QUEUED")
    second = Background(single, {"prompt": "Short one behind it", "max_tokens": 4})
    second.wait_state("QUEUED")
    a, b = snap(single, first.rid)["meta"], snap(single, second.rid)["meta"]
    # The short one's own work is 4 steps; behind 200 steps on a single slot it is predicted to wait for them.
    assert b["predicted_s"] > 0.5 * a["predicted_s"] > 0
    for bg in (first, second):
        httpx.delete(f"{single.url}/v1/requests/{bg.rid}")
        bg.join()
    release(single, hog)
