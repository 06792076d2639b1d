"""A consumer killed after reading an event and before acknowledging it: another takes it over."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from shared.wire.constants import Names
from tests.support.cluster import Cluster
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for


def _live_tokenizers(cluster: Cluster) -> list[str]:
    import redis

    from shared.wire.constants import Names
    from shared.process.liveness import read_live

    return list(read_live(redis.Redis.from_url(cluster.redis.url), Names(cluster.ns), "tokenizer"))


def _last_id(cluster: Cluster, stream: str) -> bytes | None:
    import redis

    r = redis.Redis.from_url(cluster.redis.url)
    return r.xinfo_stream(stream)["last-generated-id"] if r.exists(stream) else None


def _pending_for(cluster: Cluster, stream: str, group: str) -> dict[str, int]:
    import redis

    r = redis.Redis.from_url(cluster.redis.url)
    return {c["name"].decode(): int(c["pending"]) for c in r.xinfo_consumers(stream, group)}


@pytest.mark.parametrize("replica", [False, True], ids=["restarted", "replica"])
def test_tokenizer_killed_before_ack_is_taken_over_and_request_finishes_once(start_cluster, replica):
    # The takeover is the subject: simulated workers. Reads block 5 s, not 100 ms: the tokenizer frozen inside one
    # stays blocked in Redis until the gateway's entry comes, which on a loaded machine takes longer than 100 ms
    # (a clean-clone make test missed all 20 tries; an added 300 ms before the request fails every time at 100 ms).
    c = start_cluster(env={**SIM, "CONVEYOR_READ_BLOCK_MS": "5000"})
    victim = c.procs["tokenizer"]
    stream = Names(c.ns).received_stream(0)
    result: dict = {}
    for _attempt in range(20):
        before = _last_id(c, stream)
        os.kill(victim.pid, signal.SIGSTOP)  # frozen inside XREADGROUP BLOCK: Redis still hands it the entry
        t = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(
                    f"{c.url}/generate", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=120
                )
            )
        )
        t.start()
        # Redis hands a new entry to a reader blocked on the stream within the XADD itself, so once the gateway's
        # entry is there, it is pending for the frozen victim or the victim was between two reads (a 1 s window
        # here instead missed all 20 tries on a loaded machine: the gateway took longer than that to add it).
        wait_for(lambda: _last_id(c, stream) != before, 60, what="the gateway's entry on the tokenizer's stream")
        if any(n > 0 for name, n in _pending_for(c, stream, "tokenizer").items() if f"-{victim.pid}-" in name):
            break
        os.kill(victim.pid, signal.SIGCONT)  # it was between two reads; try again
        t.join()
    else:
        pytest.fail("could not catch the tokenizer inside a blocking read")
    if replica:  # a second tokenizer, live when the holder dies, takes the entry over
        pid = c.start_service("tokenizer1").pid
        wait_for(lambda: any(f"-{pid}-" in k for k in _live_tokenizers(c)), 120, what="second tokenizer")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    if not replica:
        c.start_service("tokenizer2")  # a replacement claims the idle entry after CONVEYOR_CLAIM_IDLE_MS
    t.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    snap = httpx.get(f"{c.url}/v1/requests/{r.json()['request_id']}").json()
    states = [h["state"] for h in snap["history"]]
    assert states.count("PREPROCESSED") == 1 and states.count("FINISHED") == 1
    assert states[-1] == "FINISHED"
    import redis

    rc = redis.Redis.from_url(c.redis.url)
    assert rc.xlen(Names(c.ns).preprocessed_stream(0)) >= 1
    assert rc.xpending(stream, "tokenizer")["pending"] == 0
