"""A burst costs the pipeline's services round trips to Redis per tick, not per request (issue 12): at 5,000
concurrent streams the tokenizer and the scheduler were a chain of one-at-a-time round trips. Counted on the
service's own connection: one send of packed commands is one round trip."""

from __future__ import annotations

import asyncio

from redis.connection import AbstractConnection

from services.tokenizer.service import TokenizerService
from shared.wire.constants import EVENT_FIELD, GROUP_SCHEDULER, GROUP_TOKENIZER
from shared.wire.events import encode
from shared.settings import TokenizerSettings
from tests.support.cache import CACHE_DIR
from tests.support.inproc import gateway_core, mark_live, small
from tests.support.scheduling import heartbeat, preprocessed_request, scheduled_on, scheduler, state

BURST = 20
FEW = 6  # round trips a tick may take whatever its batch (read, writes, acknowledgement, ...)


class RoundTrips:
    """Counts sends of packed commands by synchronous clients while counting."""

    def __init__(self, monkeypatch):
        self.n, self.monkeypatch = 0, monkeypatch

    def __enter__(self) -> "RoundTrips":
        send = AbstractConnection.send_packed_command

        def counting(conn, command, check_health=True):
            self.n += 1
            return send(conn, command, check_health)

        self.monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
        return self

    def __exit__(self, *exc) -> None:
        self.monkeypatch.undo()


def submit(redis_server, names, n: int) -> list[str]:
    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            return [(await core.submit(small(f"Hello {i}"), 2)).request_id for i in range(n)]
        finally:
            await core.r.aclose()

    return asyncio.run(run())


def test_the_tokenizer_preprocesses_a_burst_in_a_few_round_trips(
    redis_server, redis_client, names, model_dir, monkeypatch
):
    svc = TokenizerService(TokenizerSettings(redis_url=redis_server.url, namespace=names.ns, cache_dir=CACHE_DIR))
    svc.bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    svc.tick()  # nothing to read yet: its liveness refresh and sweep are done
    mark_live(redis_client, names)  # now: loading the tokenizer may take longer than a liveness TTL
    rids = submit(redis_server, names, BURST)
    with RoundTrips(monkeypatch) as trips:
        svc.tick()
    states = {redis_client.hget(names.layer(rid, "meta"), "state") for rid in rids}
    assert states == {b"PREPROCESSED"}
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0
    assert trips.n <= FEW, f"{trips.n} round trips for {BURST} requests"


def test_the_scheduler_queues_and_places_a_burst_in_a_few_round_trips(redis_server, redis_client, names, monkeypatch):
    s = scheduler(redis_server, names)
    s.on_heartbeat(heartbeat(max_num_seqs=BURST))
    s.tick()  # nothing to read yet: its periodic work (sync, sweeps, janitor) is done
    events, trips = _burst_in_one_tick(s, redis_server, redis_client, names, monkeypatch)
    assert {state(redis_client, names, ev.request_id) for ev in events} == {"SCHEDULED"}
    assert [e.request_id for e in scheduled_on(redis_client, names)] == [ev.request_id for ev in events]
    assert redis_client.xpending(names.preprocessed_stream(0), GROUP_SCHEDULER)["pending"] == 0
    assert redis_client.hlen(names.queue(0)) == 0 and redis_client.hlen(names.assigned(0)) == BURST
    assert trips.n <= 2 * FEW, f"{trips.n} round trips for {BURST} requests"


def test_a_tick_far_over_the_ended_contexts_cap_still_places_in_a_few_round_trips(
    redis_server, redis_client, names, monkeypatch
):
    """The cap's sweep (thousands of deletions under sustained load) is not the tick's work: placements,
    deadlines and cancels never wait for it."""
    from tests.redis.test_janitor import create, end

    s = scheduler(redis_server, names, max_ended_contexts=10, janitor_interval_s=0.01)
    s.on_heartbeat(heartbeat(max_num_seqs=BURST))
    s.tick()
    end(redis_client, names, create(redis_client, names, 300))  # 290 over the cap
    events, trips = _burst_in_one_tick(s, redis_server, redis_client, names, monkeypatch)
    assert {state(redis_client, names, ev.request_id) for ev in events} == {"SCHEDULED"}
    assert trips.n <= 2 * FEW, f"{trips.n} round trips for {BURST} requests"


def _burst_in_one_tick(s, redis_server, redis_client, names, monkeypatch):
    """BURST requests preprocessed at once, then one scheduler tick: the events, and the tick's round trips."""
    events = [preprocessed_request(redis_server, names) for _ in range(BURST)]
    for ev in events:
        redis_client.xadd(names.preprocessed_stream(0), {EVENT_FIELD: encode(ev)})
    with RoundTrips(monkeypatch) as trips:
        s.tick()
    return events, trips


def test_a_workers_tokens_only_step_is_one_round_trip(redis_server, redis_client, names, monkeypatch):
    """The step a decoding batch repeats hundreds of times a second: fencing, appends and reply events in one script
    (services/worker/publisher.py, _TOKENS_LUA), not WATCH, a check, SCRIPT EXISTS and MULTI/EXEC."""
    import time

    from services.worker.engine.outputs import RequestOutput, StepResult
    from services.worker.publisher import Active
    from tests.support.scheduling import placed, step_publisher

    s = scheduler(redis_server, names)
    evs = [placed(redis_server, names, s) for _ in range(3)]
    pub = step_publisher(redis_client, names)
    active = {e.request_id: Active(e.request_id, e.reply_to, "", 3, time.time() + 60, attempt=1) for e in evs}
    for i in range(2):  # the first loads the script
        step = StepResult(outputs=[RequestOutput(e.request_id, [5 + i], i) for e in evs])
        with RoundTrips(monkeypatch) as trips:
            assert pub.publish(i + 1, step, active, lambda rid: None) == set()
    assert trips.n == 1
