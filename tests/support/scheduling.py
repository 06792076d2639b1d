"""A scheduler on a test's own Redis, with requests made as the gateway and tokenizer make them (no model)."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis

from services.scheduler import batch
from services.scheduler.service import SchedulerService
from shared.wire.bus import Delivery
from shared.wire.constants import EVENT_FIELD, GROUP_WORKER
from shared.state.context_store import ContextStore
from shared.wire.events import Heartbeat, Preprocessed, Sampling, TokenGenerated, decode
from shared.state.lifecycle import Lifecycle, State
from shared.settings import SchedulerSettings, WorkerSettings
from tests.support.cache import CACHE_DIR

WORKER = "w1"


def scheduler(redis_server, names, **kw) -> SchedulerService:
    s = SchedulerService(SchedulerSettings(redis_url=redis_server.url, namespace=names.ns, **kw))
    s.ensure_groups()
    return s


def sim_worker(redis_server, names):
    """The worker's real service (simulated engine) as WORKER, its consumer group made, nothing run yet."""
    from services.worker.service import WorkerService  # (the scheduler-only tests need not import the worker)

    w = WorkerService(
        WorkerSettings(
            redis_url=redis_server.url, namespace=names.ns, engine="sim", cache_dir=CACHE_DIR, instance_id=WORKER
        )
    )
    w.bus.ensure_group(w.stream, GROUP_WORKER)
    return w


def heartbeat(worker_id: str = WORKER, **kw) -> Heartbeat:
    base = dict(
        worker_id=worker_id,
        sent_at=time.time(),
        max_num_seqs=8,
        num_running=0,
        num_waiting=0,
        request_ids=(),
        last_read_id="",
        total_blocks=100,
        free_blocks=100,
        cached_blocks=0,
        block_size=16,
        step_time_s=0.05,
        prefill_s_per_token=0.001,
        decode_s_per_token=0.05,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    return Heartbeat(**{**base, **kw})


def preprocessed_request(
    redis_server,
    names,
    reply_to: str = "",
    adaptive: bool = False,
    max_tokens: int = 4,
    timeout_s: float = 60,
    sampling: Sampling | None = None,
    prompt_token_ids: tuple[int, ...] = (1, 2, 3),
    meta: dict | None = None,
) -> Preprocessed:
    """A request created by the gateway's script (meta: more of its meta layer) and moved to PREPROCESSED as the
    tokenizer does."""
    reply_to = reply_to or names.reply_stream("gw1")
    now = time.time()
    ev = Preprocessed(
        request_id=f"r{time.monotonic_ns()}",
        reply_to=reply_to,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling or Sampling(max_tokens=max_tokens, temperature=0.0),
        priority=0,
        deadline=now + timeout_s,
        adaptive_deadline=adaptive,
        received_at=now,
    )

    async def create():
        client = aioredis.Redis.from_url(redis_server.url)
        await ContextStore(client, names, 60).acreate(ev.request_id, {"reply_to": reply_to, **(meta or {})}, {}, ev)
        await client.aclose()

    asyncio.run(create())
    client = redis.Redis.from_url(redis_server.url)
    Lifecycle(client, names, "tokenizer", 60).transition(ev.request_id, State.PREPROCESSED)
    return ev


def place(redis_server, names, *samplings: Sampling) -> list[str]:
    """Requests placed on WORKER by the scheduler's own code, in one read of its stream."""
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat())
    events = [preprocessed_request(redis_server, names, sampling=sp) for sp in samplings]
    for ev in events:
        deliver(s, names.preprocessed_stream(0), ev)
    s.place()
    return [ev.request_id for ev in events]


def deliver(s: SchedulerService, stream: str, event) -> None:
    batch.intake(s, [Delivery(stream, "scheduler", "0-1", event)])  # the tick's own path


def state(redis_client, names, rid: str) -> str:
    return redis_client.hget(names.layer(rid, "meta"), "state").decode()


def delivered_tokens(redis_client, names, rid: str, gateway: str = "gw1") -> list[int]:
    """The tokens the request's gateway was sent on its reply stream, in order."""
    out = []
    for _, f in redis_client.xrange(names.reply_stream(gateway)):
        if isinstance(ev := decode(f[EVENT_FIELD]), TokenGenerated):
            out += [t for item in ev.items if item.request_id == rid for t in item.token_ids]
    return out


def scheduled_on(redis_client, names, worker: str = WORKER) -> list:
    return [decode(f[b"e"]) for _, f in redis_client.xrange(names.worker_stream(worker))]


def placed(redis_server, names, s: SchedulerService) -> Preprocessed:
    s.on_heartbeat(heartbeat())
    ev = preprocessed_request(redis_server, names)
    deliver(s, names.preprocessed_stream(0), ev)
    s.place()
    return ev


def step_publisher(client, names, worker: str = WORKER):
    """A worker's step publisher on the test's Redis, as the worker builds it (context TTL 60 s)."""
    from services.worker.publisher import StepPublisher

    return StepPublisher(
        client, names, worker, Lifecycle(client, names, "worker", 60), ContextStore(client, names, 60), 60
    )
