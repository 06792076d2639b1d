"""Stored responses (store=true) in Redis: one hash per response, owned by the API key that created it.

A record holds what the API shows (the response, its input items) and the conversation so far as chat turns (every
turn up to and including this response's output), so that previous_response_id costs one read, whatever the length
of the chain, and a continuation survives the deletion or expiry of an earlier response of the chain. A copy per
response is bounded by the body limit and the model's context; a chain walked at read time would cost a read per
turn instead. Any gateway reads any record: the key names the owner, not the process.

The hash's fields: `status` (the response's, apart so that a script can read it without decoding the record),
`record` (JSON), `reply_to` (the reply stream of the gateway driving it: what a cancel from any gateway needs),
`session_id` (the session it was a turn of: a continuation is a turn of it too), `gateway` (the id of the one
driving it), and for a background response `fence` (raised by each takeover: responses.takeover).
A background response is written again as it runs, only while it runs (update_running): a cancel, a deletion or
the end, whichever comes first, is the last word. Its driver's writes (the record's and its event log's) carry the
fence it took it with: once another gateway has taken it over, a stale driver's writes are refused. Its record also
keeps the request's body, what a gateway taking it over plans its output with. The key lives responses_ttl_s from
its creation (set in the same MULTI as the hash; later writes keep it): nothing in Redis outlives its TTL.

While it runs, a background response is also in the driving index (Names.responses_driving: `gateway\0owner\0id`,
read by lex, a range per gateway), which the takeover sweep reads without a SCAN; the driver takes it out at the
end, and the sweep takes out any entry whose response no longer runs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from services.gateway.edge.errors import NotFound
from shared.redis_io.replies import as_text

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

logger = logging.getLogger(__name__)

RUNNING = ("queued", "in_progress")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
EVENT_FIELD = "e"  # an event log entry's one field: the event's JSON
LOG_READ_COUNT = 1024  # entries one read of an event log takes
# Write the record only while the stored response is still running (an existing key whose status is RUNNING) and,
# ARGV[3] given, only while its fence is ARGV[3] (its driver has not been taken over).
_UPDATE_RUNNING = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'fence') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
return 1
"""
# Take over a running response from the gateway ARGV[1] (which must still be its driver) for ARGV[2]: the new fence.
_CLAIM = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return false end
if redis.call('HGET', KEYS[1], 'gateway') ~= ARGV[1] then return false end
redis.call('HSET', KEYS[1], 'gateway', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'fence', 1)
"""
# Append events (ARGV[4..]) to the log KEYS[2] while the record KEYS[1] has fence ARGV[1]; each entry notes the text
# fed so far (ARGV[2]); ARGV[3] (unless ''): the log is born here, with this TTL.
_APPEND = """
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[1] then return 0 end
for i = 4, #ARGV do redis.call('XADD', KEYS[2], '*', 'e', ARGV[i], 'f', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3])) end
return 1
"""


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as GET /v1/responses/{id} answers
    input_items: list[dict]  # this request's own input, each item with its id
    turns: list[dict]  # the conversation through this response's output, as chat messages
    reply_to: str = ""  # the reply stream of the gateway that drives it
    session_id: str = ""  # the conversation session it was a turn of (a continuation's turn is one too)
    gateway: str = ""  # the id of the gateway that drives it (its liveness says whether anyone still does)
    body: dict | None = None  # a background response's request body (what a takeover plans its output with)
    fence: int = 0  # a background response's: its driver's writes carry it (raised by each takeover)

    @property
    def request_id(self) -> str:
        return self.response["id"].removeprefix("resp_")

    def with_response(self, response: dict, turns: list[dict] | None = None) -> Stored:
        return replace(self, response=response, turns=self.turns if turns is None else turns)

    def fields(self) -> dict:
        record = {"response": self.response, "input_items": self.input_items, "turns": self.turns}
        if self.body is not None:
            record["body"] = self.body
        return {"status": self.response["status"], "record": json.dumps(record, ensure_ascii=False)}


def _key(core: GatewayCore, owner: str, response_id: str) -> str:
    return core.names.response(owner, response_id)


async def put(core: GatewayCore, owner: str, stored: Stored) -> None:
    key = _key(core, owner, stored.response["id"])
    pipe = core.r.pipeline(transaction=True)  # born with its TTL
    about = {"reply_to": stored.reply_to, "session_id": stored.session_id, "gateway": stored.gateway}
    if stored.response.get("background"):
        about["fence"] = stored.fence
    pipe.hset(key, mapping={**stored.fields(), **about})
    pipe.expire(key, core.s.responses_ttl_s)
    await pipe.execute()


async def update_running(core: GatewayCore, owner: str, stored: Stored, fence: int | None = None) -> bool:
    """Write stored if the stored response still runs (not cancelled, deleted, expired or ended) and, fence given,
    is still driven under that fence (not taken over); True if written."""
    f = stored.fields()
    key = _key(core, owner, stored.response["id"])
    fenced = "" if fence is None else str(fence)
    return bool(await core.r.eval(_UPDATE_RUNNING, 1, key, f["status"], f["record"], fenced))


async def claim(core: GatewayCore, owner: str, stored: Stored) -> int | None:
    """Take the running response over from its driver stored.gateway: the new fence, or None when it has ended or
    another gateway took it first (exactly one claim of a driver succeeds)."""
    fence = await core.r.eval(_CLAIM, 1, _key(core, owner, stored.response["id"]), stored.gateway, core.id)
    return None if fence is None else int(fence)


async def get(core: GatewayCore, owner: str, response_id: str, param: str = "response_id") -> Stored:
    """The stored response, or a 404 naming param (unknown, expired, deleted, or another key's look alike)."""
    raw = await core.r.hgetall(_key(core, owner, response_id))
    if not raw:
        raise NotFound(f"{param}: no response {response_id!r} (never stored, deleted, or expired)", param, "not_found")
    fields = {as_text(k): as_text(v) for k, v in raw.items()}
    data = json.loads(fields["record"])
    about = {k: fields.get(k, "") for k in ("reply_to", "session_id", "gateway")}
    fence = int(fields.get("fence") or 0)
    return Stored(data["response"], data["input_items"], data["turns"], **about, body=data.get("body"), fence=fence)


async def delete(core: GatewayCore, owner: str, response_id: str) -> None:
    if not await core.r.delete(_key(core, owner, response_id), core.names.response_events(owner, response_id)):
        raise NotFound(f"response_id: no response {response_id!r}", "response_id", "not_found")


def terminal_event(status: str) -> str:
    """The type of the event that ends a stream of a response ended so (cancelled too is a failure to answer)."""
    return f"response.{status}" if status in ("completed", "incomplete") else "response.failed"


async def append_events(
    core: GatewayCore, owner: str, response_id: str, events: list[dict], first: bool, fence: int, fed: int
) -> bool:
    """Append a background response's events to its log, while its driver's fence holds (else refused: False). fed:
    the characters of text its output builder has been fed so far (what a takeover feeds its own first); first: the
    log is born here, with its TTL."""
    keys = (_key(core, owner, response_id), core.names.response_events(owner, response_id))
    ttl = str(core.s.responses_ttl_s) if first else ""
    encoded = [json.dumps(event, ensure_ascii=False) for event in events]
    return bool(await core.r.eval(_APPEND, 2, *keys, str(fence), str(fed), ttl, *encoded))


async def read_log(core: GatewayCore, owner: str, response_id: str) -> list[tuple[int, dict]]:
    """The whole event log, as (text fed when it was logged, event): what a takeover continues from."""
    key, after, out = core.names.response_events(owner, response_id), "-", []
    while entries := await core.r.xrange(key, after, "+", count=LOG_READ_COUNT):
        for entry_id, fields in entries:
            named = {as_text(k): as_text(v) for k, v in fields.items()}
            out.append((int(named.get("f") or 0), json.loads(named[EVENT_FIELD])))
        after = "(" + as_text(entries[-1][0])
    return out


async def read_events(
    core: GatewayCore, owner: str, response_id: str, after: str, block_ms: int | None
) -> list[tuple[str, dict]]:
    """The log's entries after entry id `after` (blocking up to block_ms for the first, None: not at all)."""
    key = core.names.response_events(owner, response_id)
    reply = await core.r.xread({key: after}, count=256, block=block_ms)
    out = []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            event = next(v for k, v in fields.items() if as_text(k) == EVENT_FIELD)
            out.append((as_text(entry_id), json.loads(event)))
    return out


async def has_events(core: GatewayCore, owner: str, response_id: str) -> bool:
    return bool(await core.r.exists(core.names.response_events(owner, response_id)))


def _member(gateway: str, owner: str, response_id: str) -> str:
    return f"{gateway}\0{owner}\0{response_id}"


async def index_driving(core: GatewayCore, owner: str, response_id: str) -> None:
    """Note the response as driven by this gateway."""
    key = core.names.responses_driving()
    pipe = core.r.pipeline(transaction=True)
    pipe.zadd(key, {_member(core.id, owner, response_id): 0})
    pipe.expire(key, core.s.responses_ttl_s)  # refreshed by every new entry: an idle cluster's expires
    await pipe.execute()


async def unindex(core: GatewayCore, gateway: str, owner: str, response_id: str) -> None:
    await core.r.zrem(core.names.responses_driving(), _member(gateway, owner, response_id))


async def driving_gateways(core: GatewayCore, limit: int) -> list[str]:
    """The gateways with entries in the driving index (at most limit): one range read of one entry per gateway."""
    key, low, out = core.names.responses_driving(), "-", []
    while len(out) < limit and (first := await core.r.zrangebylex(key, low, "+", start=0, num=1)):
        out.append(as_text(first[0]).split("\0", 1)[0])
        low = f"[{out[-1]}\1"  # past every entry of that gateway
    return out


async def driven_by(core: GatewayCore, gateway: str, limit: int) -> list[tuple[str, str]]:
    """(owner, response id) of at most limit of the responses the index has under gateway."""
    got = await core.r.zrangebylex(core.names.responses_driving(), f"[{gateway}\0", f"({gateway}\1", 0, limit)
    return [tuple(as_text(m).split("\0")[1:3]) for m in got]
