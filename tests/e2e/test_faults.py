"""No request lost: the death of any one process, or a Redis restart, is survived.

Each test runs real processes on a Redis of its own and asserts that every client got exactly one
final answer, that greedy outputs equal a run with no fault, and that surviving workers hold no
KV block at the end. The faults are the control plane's business: the workers run the simulated engine
(CONVEYOR_ENGINE=sim, deterministic tokens per prompt) except in the worker-killed test, which checks that a
moved request's greedy output with the real model equals transformers' uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest
import redis

from shared.wire.constants import Names
from shared.process.liveness import read_live
from shared.redis_io.redis_server import RedisServer
from tests.support.cluster import Cluster
from tests.support.sim_reference import SIM, sim_greedy
from tests.support.waiting import wait_for

FAST = {"CONVEYOR_LIVENESS_TTL_S": "3", "CONVEYOR_HEARTBEAT_INTERVAL_S": "0.5", "CONVEYOR_CLAIM_IDLE_MS": "1000"}
PROMPTS = [f"Write one sentence about the number {i}." for i in range(12)]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def sim_reference(model_dir):
    return sim_greedy(model_dir)


def _live_workers(c: Cluster) -> dict[str, dict]:
    r = redis.Redis.from_url(c.redis.url)
    return read_live(r, Names(c.ns), "worker")


def _idle(c: Cluster) -> bool:
    infos = _live_workers(c)
    return bool(infos) and all(i["held"] == 0 and i["free_blocks"] == i["total_blocks"] for i in infos.values())


async def _stream(client: httpx.AsyncClient, body: dict, seen: dict) -> dict:
    """One streaming request; returns its ids in order, the index of every delta, the token id of every log
    probability entry, and the final event."""
    out = {"ids": [], "indexes": [], "final": None, "finals": 0, "logprob_ids": []}
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            seen[ev["request_id"]] = len(out["ids"])
            if "finish_reason" in ev:
                out["final"], out["finals"] = ev, out["finals"] + 1
            else:
                out["indexes"].append((ev["index"], len(ev["token_ids"])))
                out["ids"] += ev["token_ids"]
                out["logprob_ids"] += [e["token_id"] for e in ev.get("logprobs", [])]
    return out


def _check_streams(results: list[dict], expected: list[list[int]]) -> None:
    for res, exp in zip(results, expected):
        assert res["finals"] == 1 and res["final"]["finish_reason"] in ("stop", "length"), res["final"]
        # Contiguous: every delta starts where the previous ended (no gap, no repeat).
        pos = 0
        for idx, n in res["indexes"]:
            assert idx == pos, (idx, pos)
            pos += n
        assert res["ids"] == exp
        assert res["logprob_ids"] == exp, "one log probability entry per token: none lost or repeated by the move"


def _expected(hf_reference) -> list[list[int]]:
    return [hf_reference(hf_reference.prompt_ids(p), MAX_TOKENS) for p in PROMPTS]


def _send_in_background(c: Cluster, prefix: str, n: int, max_tokens: int) -> tuple[threading.Thread, dict]:
    """n concurrent greedy requests from a thread; box["r"] holds their responses once it is joined."""
    box: dict = {}

    async def send():
        async with httpx.AsyncClient(base_url=c.url, timeout=300) as client:
            return await asyncio.gather(
                *[
                    client.post(
                        "/generate",
                        json={
                            "prompt": f"{prefix} {i}:",
                            "max_tokens": max_tokens,
                            "ignore_eos": True,
                            "temperature": 0,
                        },
                    )
                    for i in range(n)
                ]
            )

    t = threading.Thread(target=lambda: box.update(r=asyncio.run(send())))
    t.start()
    return t, box


def _run_with_fault(c: Cluster, fault) -> list[dict]:
    """Send PROMPTS as concurrent streams; call fault() once every stream has some tokens."""

    async def main():
        seen: dict = {}
        async with httpx.AsyncClient(base_url=c.url, timeout=300) as client:
            body = {"max_tokens": MAX_TOKENS, "temperature": 0, "timeout": 600, "logprobs": 1}
            tasks = [asyncio.create_task(_stream(client, {"prompt": p, **body}, seen)) for p in PROMPTS]
            t0 = time.monotonic()
            while len([v for v in seen.values() if v >= 2]) < len(PROMPTS) // 2 and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.05)
            await asyncio.get_running_loop().run_in_executor(None, fault)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


@contextlib.contextmanager
def _two_workers_fault_on_worker0(start_cluster, hf_reference, fault, env: dict):
    """Two workers, PROMPTS streamed, fault(worker0's process) mid-generation; yields (cluster, victim,
    request ids) once every stream checked out, then waits for the surviving worker to hold nothing."""
    expected = _expected(hf_reference)
    c = start_cluster(workers=2, env=env)
    wait_for(lambda: len(_live_workers(c)) == 2, 30, what="two workers")
    victim = c.procs["worker0"]
    results = _run_with_fault(c, lambda: fault(victim))
    _check_streams(results, expected)
    yield c, victim, [res["final"]["request_id"] for res in results]
    wait_for(lambda: _idle(c), 30, what="surviving worker idle")


def _moved(c: Cluster, rids: list[str], reason: str) -> list[str]:
    """The requests whose history shows a move back to the queue for `reason`."""
    return [
        rid
        for rid in rids
        if any(h.get("reason") == reason for h in httpx.get(f"{c.url}/v1/requests/{rid}").json()["history"])
    ]


def test_worker_killed_mid_generation_loses_no_request(start_cluster, hf_reference):
    with _two_workers_fault_on_worker0(start_cluster, hf_reference, lambda p: os.kill(p.pid, signal.SIGKILL), FAST) as (
        c,
        _victim,
        rids,
    ):
        moved = _moved(c, rids, "worker_lost")
        assert moved, "no request was on the killed worker"
        snap = httpx.get(f"{c.url}/v1/requests/{moved[0]}").json()
        assert snap["exec"]["attempt"] == 2


def test_worker_sigterm_hands_back_what_it_cannot_finish_and_nothing_is_lost(start_cluster, sim_reference):
    with _two_workers_fault_on_worker0(
        start_cluster,
        sim_reference,
        lambda p: p.send_signal(signal.SIGTERM),
        {**FAST, **SIM, "CONVEYOR_DRAIN_TIMEOUT_S": "0.5"},
    ) as (c, victim, rids):
        assert victim.wait(30) == 0, c.logs("worker0")
        assert _moved(c, rids, "shutdown"), "no request was handed back by the stopping worker"


def test_hung_worker_is_treated_as_dead(start_cluster, sim_reference):
    expected = _expected(sim_reference)
    c = start_cluster(workers=2, env={**FAST, **SIM})
    wait_for(lambda: len(_live_workers(c)) == 2, 30, what="two workers")
    victim = c.procs["worker0"]
    results = _run_with_fault(c, lambda: os.kill(victim.pid, signal.SIGSTOP))
    _check_streams(results, expected)
    os.kill(victim.pid, signal.SIGCONT)  # it wakes up, finds its requests moved, and drops them
    wait_for(lambda: len(_live_workers(c)) == 2 and _idle(c), 60, what="both workers idle")


@pytest.mark.parametrize("replica", [False, True], ids=["restarted", "replica"])
def test_scheduler_killed_with_queued_requests_loses_none(start_cluster, replica):
    c = start_cluster(env={**FAST, **SIM, "CONVEYOR_MAX_NUM_SEQS": "1", "CONVEYOR_QUEUE_SLACK": "0"})
    if replica:
        c.start_service("scheduler2")
    t, box = _send_in_background(c, "Item", 4, 12)
    r = redis.Redis.from_url(c.redis.url)
    wait_for(lambda: r.hlen(Names(c.ns).queue(0)) >= 2, 60, what="requests queued")
    os.kill(c.procs["scheduler"].pid, signal.SIGKILL)
    c.procs["scheduler"].wait()
    if not replica:
        c.start_service("scheduler3")
    t.join(240)
    assert [x.status_code for x in box["r"]] == [200] * 4
    assert all(len(x.json()["token_ids"]) == 12 for x in box["r"])
    wait_for(lambda: _idle(c), 30, what="worker idle")


def test_redis_restart_with_append_only_file_finishes_queued_and_running(start_cluster):
    c = start_cluster(
        env={**FAST, **SIM, "CONVEYOR_MAX_NUM_SEQS": "1", "CONVEYOR_QUEUE_SLACK": "0"}, redis_appendonly=True
    )
    t, box = _send_in_background(c, "Entry", 3, 24)
    r = redis.Redis.from_url(c.redis.url)
    wait_for(
        lambda: r.hlen(Names(c.ns).queue(0)) >= 1 and r.zcard(Names(c.ns).state_set(0, "DECODING")) == 1,
        60,
        what="one running, others queued",
    )
    port = c.redis.port
    c.redis.stop()  # SIGTERM: Redis flushes its append-only file
    wait_for(lambda: httpx.get(f"{c.url}/ready", timeout=5).status_code == 503, 20, what="not ready")
    c.redis = RedisServer(c.redis.data_dir, port=port, appendonly=True).start()
    t.join(240)
    assert [x.status_code for x in box["r"]] == [200] * 3, [x.text for x in box["r"]]
    assert all(len(x.json()["token_ids"]) == 24 for x in box["r"])
    wait_for(lambda: httpx.get(f"{c.url}/ready", timeout=5).status_code == 200, 30, what="ready again")
    wait_for(lambda: _idle(c), 30, what="worker idle")


def test_gateway_killed_with_streams_open_other_gateway_serves_and_blocks_are_freed(start_cluster):
    c = start_cluster(env={**FAST, **SIM})
    other_port = __import__("shared.redis_io.redis_server", fromlist=["free_port"]).free_port()
    c.start_service("gateway2", {"CONVEYOR_PORT": str(other_port)})
    wait_for(lambda: _ok(f"http://127.0.0.1:{other_port}/ready"), 120, what="second gateway")

    def orphan():
        try:
            with httpx.stream(
                "POST",
                f"{c.url}/generate",
                json={"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True},
                timeout=60,
            ) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            return  # its gateway died under it: expected

    t = threading.Thread(target=orphan)
    t.start()
    r = redis.Redis.from_url(c.redis.url)
    wait_for(lambda: r.zcard(Names(c.ns).state_set(0, "DECODING")) == 1, 60, what="decoding")
    rid = r.zrange(Names(c.ns).state_set(0, "DECODING"), 0, 0)[0].decode()
    os.kill(c.procs["gateway"].pid, signal.SIGKILL)
    t.join(60)
    ok = httpx.post(f"http://127.0.0.1:{other_port}/generate", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200
    wait_for(lambda: r.hget(Names(c.ns).layer(rid, "meta"), "state") == b"CANCELLED", 30, what="orphan cancelled")
    assert r.hget(Names(c.ns).layer(rid, "meta"), "reason") == b"client_disconnect"
    wait_for(lambda: _idle(c), 30, what="worker idle")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
