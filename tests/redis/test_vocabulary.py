"""One lifecycle vocabulary: typed states and reasons on the wire, the Lua scripts' state sets written from the
Python table, and draining said by its own heartbeat field."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.scheduler import assignments
from services.scheduler.state import WorkerView
from services.worker.engine.outputs import RequestOutput, StepResult
from services.worker.publisher import Active
from shared.state import lifecycle
from shared.wire.events import (
    CancelRequested,
    Failed,
    KvResyncRequested,
    Reason,
    ResyncReason,
    State,
    TimedOut,
    decode,
    encode,
)
from shared.state.lifecycle import TERMINAL, lua_in
from tests.support.scheduling import heartbeat, placed, scheduler, step_publisher


@pytest.mark.parametrize("reason", list(Reason))
def test_a_reason_is_its_plain_string_on_the_wire(reason):
    as_enum = encode(Failed(request_id="r", reason=reason, message="m"))
    as_str = encode(Failed(request_id="r", reason=str(reason.value), message="m"))
    assert as_enum == as_str  # what a sender of the plain string (an older one) wrote, byte for byte
    back = decode(as_str)
    assert back.reason is reason and f"{back.reason}" == reason.value


def test_cancel_and_resync_reasons_decode_typed():
    assert decode(encode(CancelRequested(request_id="r", reason="stop_string"))).reason is Reason.STOP_STRING
    assert decode(encode(KvResyncRequested(worker_id="w", reason="gap"))).reason is ResyncReason.GAP


def test_timed_out_carries_the_state_it_was_in():
    back = decode(encode(TimedOut(request_id="r", state=State.QUEUED, service="scheduler")))
    assert back.state is State.QUEUED and f"{back.state}" == "QUEUED"
    assert decode(encode(TimedOut(request_id="r", service="worker"))).state is None


def test_an_unknown_reason_is_refused_at_decoding():
    payload = msgspec.msgpack.encode({"type": "failed", "request_id": "r", "reason": "no_such_reason", "message": ""})
    with pytest.raises(Exception):
        decode(payload)


def test_lua_state_sets_are_written_from_the_table():
    terminal = lua_in("cur", TERMINAL)
    assert terminal.count(" or ") == len(TERMINAL) - 1 and all(f"'{s.value}'" in terminal for s in TERMINAL)
    assert terminal in lifecycle._TRANSITION_LUA
    assert lua_in("st", TERMINAL) in assignments._RECORD_LUA
    for script in (lifecycle._TRANSITION_LUA, assignments._RECORD_LUA):
        assert "@" not in script  # every placeholder was filled


def test_a_draining_worker_has_no_free_slot_whatever_its_max_num_seqs():
    view = WorkerView("w1", heartbeat(max_num_seqs=8, draining=True), time.monotonic())
    assert view.free_slots(4) == 0
    view.observe(heartbeat(max_num_seqs=8))
    assert view.free_slots(4) == 12


def test_the_worker_knows_the_state_it_moved_a_request_to(redis_server, redis_client, names):
    """What its TimedOut says: the state the worker's last applied transition left the request in."""
    s = scheduler(redis_server, names)
    ev = placed(redis_server, names, s)
    pub = step_publisher(redis_client, names)
    active = {ev.request_id: Active(ev.request_id, ev.reply_to, "", 3, time.time() + 60, attempt=1)}
    assert active[ev.request_id].state is State.SCHEDULED
    pub.publish_scheduled([(ev.request_id, State.PREFILLING)], active)
    assert active[ev.request_id].state is State.PREFILLING
    step = StepResult(outputs=[RequestOutput(ev.request_id, [42], 0)], transitions=[(ev.request_id, State.DECODING)])
    pub.publish(1, step, active, lambda rid: None)
    assert active[ev.request_id].state is State.DECODING


def test_a_feed_record_is_written_with_exactly_the_fields_its_decoder_reads():
    """Both scripts that append to the lifecycle feed write its XADD from LIFECYCLE_FEED_FIELDS: a field left out
    or unknown to the decoder cannot be written."""
    import pytest

    from shared.wire.constants import LIFECYCLE_FEED_FIELDS
    from shared.state.lifecycle import lua_feed_xadd

    values = {("from_" if f == "from" else f): f"v{i}" for i, f in enumerate(LIFECYCLE_FEED_FIELDS)}
    line = lua_feed_xadd("KEYS[1]", "ARGV[1]", **values)
    assert line.endswith(", ".join(f"'{f}', v{i}" for i, f in enumerate(LIFECYCLE_FEED_FIELDS)) + ")")
    with pytest.raises(ValueError):
        lua_feed_xadd("KEYS[1]", "ARGV[1]", **{k: v for k, v in values.items() if k != "worker"})
    with pytest.raises(ValueError):
        lua_feed_xadd("KEYS[1]", "ARGV[1]", **values, extra="x")
