"""Liveness: one hash per service kind, an entry live while younger than its TTL, dead ones pruned by readers."""

from __future__ import annotations

import time

import msgspec

from services.worker.heartbeat import Heartbeater
from shared.process import liveness
from shared.wire.events import Heartbeat
from shared.process.runtime import Liveness


def test_an_entry_is_live_while_younger_than_its_ttl():
    raw = {b"a": liveness.encode_entry(5, at=100.0), b"b": liveness.encode_entry(5, {"running": 2}, at=94.0)}
    live, prune = liveness.split_entries(raw, now=105.0)
    assert set(live) == {"a"} and live["a"]["ttl"] == 5 and prune == []
    live, _ = liveness.split_entries(raw, now=98.0)
    assert live["b"]["running"] == 2 and set(live) == {"a", "b"}


def test_readers_prune_entries_dead_for_ten_ttls_and_keep_recently_dead_ones(redis_client, names):
    now = time.time()
    for instance, age in (("fresh", 0), ("recent", 20), ("long-gone", 60)):
        Liveness(names, "worker", instance, 1.0, 5).refresh(redis_client, {"at": now - age})
    assert set(liveness.read_live(redis_client, names, "worker", now=now)) == {"fresh"}
    assert set(redis_client.hkeys(names.live_hash("worker"))) == {b"fresh", b"recent"}


def test_cleared_liveness_removes_its_instance_at_once(redis_client, names):
    live = Liveness(names, "tokenizer", "tok-1", 1.0, 5.0)
    live.refresh(redis_client)
    assert set(Liveness.read(redis_client, names, "tokenizer")) == {"tok-1"}
    live.clear(redis_client)
    assert Liveness.read(redis_client, names, "tokenizer") == {}


def test_the_hash_expires_when_nobody_refreshes_it(redis_client, names):
    Liveness(names, "scheduler", "sch-1", 1.0, 5.0).refresh(redis_client)
    assert 0 < redis_client.ttl(names.live_hash("scheduler")) <= liveness.MIN_HASH_TTL_S
    Liveness(names, "scheduler", "sch-1", 1.0, 30.0).refresh(redis_client)
    assert redis_client.ttl(names.live_hash("scheduler")) > 10 * 30 - 5


def test_a_worker_heartbeat_writes_its_summary_into_the_workers_hash(redis_client, names):
    beat = Heartbeater(redis_client, Liveness(names, "worker", "w-1", 1.0, 5.0))
    beat.update(
        Heartbeat(
            worker_id="w-1",
            sent_at=0.0,
            max_num_seqs=4,
            num_running=2,
            num_waiting=1,
            request_ids=("r1", "r2"),
            last_read_id="0-0",
            total_blocks=64,
            free_blocks=60,
            cached_blocks=3,
            block_size=16,
            step_time_s=0.01,
            prefill_s_per_token=0.001,
            decode_s_per_token=0.01,
            num_preemptions=0,
            prefix_cache_queries=5,
            prefix_cache_hits=2,
            step_no=9,
        )
    )
    beat.beat()
    entry = msgspec.json.decode(redis_client.hget(names.live_hash("worker"), "w-1"))
    assert entry["running"] == 2 and entry["held"] == 2 and entry["step"] == 9 and entry["ttl"] == 5.0
    assert abs(entry["at"] - time.time()) < 5
    assert Liveness.read(redis_client, names, "worker")["w-1"]["free_blocks"] == 60
