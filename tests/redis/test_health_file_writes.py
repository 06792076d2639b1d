"""The health file (shared/process/health_file.py): written after each liveness write Redis accepted, never before,
gone when the entry is cleared: what `conveyor health` reads in a container instead of Redis."""

from __future__ import annotations

import time

import pytest
import redis

from services.worker.heartbeat import Heartbeater
from shared.process import health_file
from shared.wire.events import Heartbeat
from shared.redis_io.redis_server import free_port
from shared.process.runtime import Liveness

TTL_S = 5.0
IDLE = dict.fromkeys(
    ("num_running", "num_waiting", "total_blocks", "free_blocks", "cached_blocks", "num_preemptions"), 0
)
IDLE |= dict.fromkeys(("step_time_s", "prefill_s_per_token", "decode_s_per_token"), 0.0)
IDLE |= {"request_ids": (), "last_read_id": "0-0", "block_size": 16, "prefix_cache_queries": 0, "prefix_cache_hits": 0}


def _live_until(folder, service: str) -> float:
    return float((folder / service).read_text())


def test_a_refresh_redis_accepted_tells_the_health_file_until_when_it_is_live(redis_client, names, tmp_path):
    before = time.time()
    Liveness(names, "tokenizer", "tok-1", 1.0, TTL_S, str(tmp_path)).refresh(redis_client)
    assert before + TTL_S <= _live_until(tmp_path, "tokenizer") <= time.time() + TTL_S
    assert health_file.check("tokenizer", str(tmp_path))[0]


def test_a_refresh_redis_refused_writes_no_health_file(names, tmp_path):
    away = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        Liveness(names, "scheduler", "sch-1", 1.0, TTL_S, str(tmp_path)).refresh(away)
    assert not (tmp_path / "scheduler").exists()


def test_a_worker_heartbeat_tells_the_health_file(redis_client, names, tmp_path):
    beat = Heartbeater(redis_client, Liveness(names, "worker", "w-1", 1.0, TTL_S, str(tmp_path)))
    beat.update(Heartbeat(worker_id="w-1", sent_at=0.0, max_num_seqs=4, **IDLE))
    beat.beat()
    assert _live_until(tmp_path, "worker") >= time.time() + TTL_S - 1


def test_a_cleared_entry_removes_the_health_file(redis_client, names, tmp_path):
    live = Liveness(names, "gateway", "gw-1", 1.0, TTL_S, str(tmp_path))
    live.refresh(redis_client)
    live.clear(redis_client)
    assert health_file.check("gateway", str(tmp_path)) == (
        False,
        f"{tmp_path / 'gateway'}: none yet (no liveness write of a gateway here has succeeded)",
    )


def test_a_health_folder_that_cannot_be_written_never_stops_the_entry_being_cleared(redis_client, names, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    live = Liveness(names, "scheduler", "sch-1", 1.0, TTL_S, str(blocked))
    live.refresh(redis_client)
    live.clear(redis_client)
    assert Liveness.read(redis_client, names, "scheduler") == {}
