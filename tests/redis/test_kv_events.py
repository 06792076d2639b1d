"""KV events from the engine to the scheduler's index: the block manager notes stored and evicted hashes, the
worker publishes them (services/worker/kv_events.py), the scheduler rebuilds its index from them after a restart
and after the capped stream was trimmed. The engine is the real one with the simulated runner (no sleeps)."""

from __future__ import annotations


from services.scheduler.routing import decision_fields
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.kv.block_manager import BlockManager
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import SimRunner
from services.worker.kv_events import KvEventPublisher
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Bus
from shared.wire.constants import EVENT_FIELD
from shared.wire.events import KvResyncRequested, encode, decode
from tests.support.scheduling import heartbeat, scheduler

TIMING = SimTiming(0.0, 0.0, 0.0, 0.0)
GREEDY = SamplingOptions(temperature=0.0, max_tokens=4)


def sim_engine(vocab, num_blocks: int = 64) -> LLMEngine:
    cfg = EngineConfig(num_kv_blocks=num_blocks, max_num_batched_tokens=512, max_num_seqs=8)
    runner = SimRunner(TIMING, vocab, num_blocks, sleep=lambda _s: None)
    return LLMEngine(runner, cfg, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len)


def run(engine: LLMEngine, rid: str, prompt: list[int], **kw) -> int:
    """Run one request to its end -> the cached tokens it reported."""
    engine.add_request(EngineRequest(rid, prompt, kw.pop("sampling", GREEDY), **kw))
    cached = 0
    while engine.has_unfinished():
        for o in engine.step().outputs:
            cached = max(cached, o.num_cached_tokens)
    return cached


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_block_manager_notes_stored_and_evicted_hashes_while_tracking():
    bm = BlockManager(2, 4, True)
    bm.track_kv_events = True
    h1, h2, h3 = block_hashes(list(range(12)), 4)
    a, b = bm.allocate(2)
    bm.register(a, h1)
    bm.register(b, h2)
    assert bm.take_kv_events() == ([h1, h2], [])
    bm.release([a, b])
    (c,) = bm.allocate(1)  # evicts the least recently released: b (tail blocks are released first)
    bm.register(c, h3)
    assert bm.take_kv_events() == ([h3], [h2])
    assert bm.take_kv_events() == ([], [])


def test_block_manager_notes_nothing_when_not_tracking():
    bm = BlockManager(2, 4, True)
    (a,) = bm.allocate(1)
    bm.register(a, block_hashes(list(range(4)), 4)[0])
    assert bm.take_kv_events() == ([], [])


def test_the_tokenizer_attaches_the_block_hashes_the_engine_computes(redis_server, names, vocab):
    from services.tokenizer.service import TokenizerService
    from shared.wire.events import RequestReceived, Sampling
    from shared.settings import TokenizerSettings

    tok = TokenizerService(TokenizerSettings(redis_url=redis_server.url, namespace=names.ns))
    ev = RequestReceived(
        request_id="r1",
        reply_to="x",
        prompt="The printing press changed Europe. " * 12,
        sampling=Sampling(max_tokens=4),
        deadline=0,
        received_at=0,
    )
    ids = tok.pre.token_ids(ev)
    pre = tok._preprocessed(ev, ids, "")
    assert pre.block_size == 16 and len(pre.block_hashes) == len(ids) // 16 >= 4
    engine = sim_engine(vocab)
    engine.add_request(EngineRequest("r1", ids, GREEDY))
    engine.step()  # admission hashes the prompt's full blocks
    assert tuple(engine.scheduler.running[0].block_hashes[: len(pre.block_hashes)]) == pre.block_hashes


def test_cached_tokens_count_only_prompt_tokens_reused_at_first_admission(vocab):
    engine = sim_engine(vocab, num_blocks=10)
    long = SamplingOptions(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request(EngineRequest("victim", prompt(48), long, priority=1))
    for _ in range(30):  # it decodes into its own blocks, then a more important request needs them
        engine.step()
    engine.add_request(EngineRequest("urgent", prompt(64, start=5000), GREEDY, priority=0))
    cached = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            cached[o.request_id] = max(cached.get(o.request_id, 0), o.num_cached_tokens)
    assert engine.stats().num_preemptions >= 1
    assert cached["victim"] == 0, "re-finding its own blocks after a preemption is not a reuse"
    assert run(engine, "again", prompt(48)) == 32  # a second request with its prompt reuses 2 full blocks of it


def worker_side(redis_server, names, vocab, worker_id: str = "w1"):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    engine = sim_engine(vocab)
    pub = KvEventPublisher(Bus(client, names, worker_id, 100, 1000, 5), worker_id, engine, 16)
    pub.start()
    return client, engine, pub


def beat(client, names, pub: KvEventPublisher) -> None:
    hb = heartbeat(pub.worker_id, kv_incarnation=pub.incarnation, kv_seq=pub.seq)
    client.xadd(names.heartbeat_stream, {EVENT_FIELD: encode(hb)})


def test_scheduler_rebuilds_its_index_from_the_stream_after_a_restart(redis_server, names, vocab):
    client, engine, pub = worker_side(redis_server, names, vocab)
    p = prompt(80)
    run(engine, "r1", p)
    pub.publish_changes()
    beat(client, names, pub)
    first = scheduler(redis_server, names)
    first.read_heartbeats()
    assert first.router.index.match(block_hashes(p, 16)) == {"w1": 5}
    restarted = scheduler(redis_server, names)  # a new process: an empty index, the stream replayed
    restarted.read_heartbeats()
    assert restarted.router.index.match(block_hashes(p, 16)) == {"w1": 5}
    assert not restarted.router.index.lagging


def test_scheduler_asks_a_worker_to_announce_its_cache_when_the_stream_was_trimmed(redis_server, names, vocab):
    client, engine, pub = worker_side(redis_server, names, vocab)
    p = prompt(80)
    run(engine, "r1", p)
    pub.publish_changes()
    client.xtrim(names.kv_events_stream, maxlen=0)  # everything it published is gone
    beat(client, names, pub)
    s = scheduler(redis_server, names)
    s.read_heartbeats()
    assert s.router.index.match(block_hashes(p, 16)) == {} and "w1" in s.router.index.lagging
    asked = client.xrange(names.worker_stream("w1"))
    assert [type(decode(f[EVENT_FIELD])) for _, f in asked] == [KvResyncRequested]
    pub.announce()  # what the worker does when it reads the request
    s.read_heartbeats()
    assert s.router.index.match(block_hashes(p, 16)) == {"w1": 5} and not s.router.index.lagging


def test_scheduler_drops_the_index_entries_of_a_dead_worker(redis_server, names, vocab):
    client, engine, pub = worker_side(redis_server, names, vocab)
    p = prompt(80)
    run(engine, "r1", p)
    pub.publish_changes()
    s = scheduler(redis_server, names, liveness_ttl_s=0.2, heartbeat_interval_s=0.1)
    s.on_heartbeat(heartbeat("w1", kv_incarnation=pub.incarnation, kv_seq=pub.seq))
    s.read_heartbeats()
    assert s.router.index.match(block_hashes(p, 16)) == {"w1": 5}
    s._contact_since = float("-inf")  # in contact with Redis all along
    s.workers["w1"].seen_at -= 1.0  # its last heartbeat is older than the liveness TTL
    s.recover_lost()
    assert s.router.index.match(block_hashes(p, 16)) == {} and "w1" not in s.router.index.holders


def test_scheduler_drops_the_replayed_entries_of_a_worker_it_never_hears_from(redis_server, names, vocab):
    from tests.support.waiting import wait_for

    client, engine, pub = worker_side(redis_server, names, vocab, worker_id="gone")
    run(engine, "r1", prompt(80))
    pub.publish_changes()  # and then it died, before this scheduler started: no heartbeat of it is left
    s = scheduler(redis_server, names, liveness_ttl_s=0.2, heartbeat_interval_s=0.1)
    s.read_heartbeats()
    assert "gone" in s.router.index.holders
    s._contact_since = float("-inf")  # in contact with Redis all along
    wait_for(lambda: (s.recover_lost(), "gone" not in s.router.index.holders)[1], 10, what="the entries dropped")
    assert not s.router.index.by_hash


def test_the_routing_decision_is_recorded_with_every_candidates_matched_blocks():
    from services.scheduler.placement import Candidate, Placement

    d = Placement("kv").choose(5, 6, [Candidate("a", 4, 0, 100, 100, 0), Candidate("b", 0, 0, 100, 100, 0)])
    assert decision_fields(d) == {
        "routing": "kv",
        "routing_reason": "overlap",
        "prompt_blocks": 5,
        "matched_blocks": {"a": 4, "b": 0},
    }
