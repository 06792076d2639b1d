"""Stored responses (store=true) in Redis: one hash per response, owned by the API key that created it.

A record holds what the API shows (the response, its input items) and the conversation so far as chat turns (every
turn up to and including this response's output), so that previous_response_id costs one read, whatever the length
of the chain, and a continuation survives the deletion or expiry of an earlier response of the chain. A copy per
response is bounded by the body limit and the model's context; a chain walked at read time would cost a read per
turn instead. Any gateway reads any record: the key names the owner, not the process.

The hash's fields: `status` (the response's, apart so that a script can read it without decoding the record),
`record` (JSON), `reply_to` (the reply stream of the gateway driving it: what a cancel from any gateway needs),
`session_id` (the session it was a turn of: a continuation is a turn of it too), `gateway` (the id of the one
driving it).
A background response is written again as it runs, only while it runs (update_running): a cancel, a deletion or
the end, whichever comes first, is the last word. The key lives responses_ttl_s from its creation (set in the same
MULTI as the hash; later writes keep it): nothing in Redis outlives its TTL.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from services.gateway.edge.errors import NotFound
from shared.liveness import aread_live
from shared.replies import as_text

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

logger = logging.getLogger(__name__)

RUNNING = ("queued", "in_progress")
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
EVENT_FIELD = "e"  # an event log entry's one field: the event's JSON
# Write the record only while the stored response is still running (an existing key whose status is RUNNING).
_UPDATE_RUNNING = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' or status == 'in_progress' then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
    return 1
end
return 0
"""


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as GET /v1/responses/{id} answers
    input_items: list[dict]  # this request's own input, each item with its id
    turns: list[dict]  # the conversation through this response's output, as chat messages
    reply_to: str = ""  # the reply stream of the gateway that drives it
    session_id: str = ""  # the conversation session it was a turn of (a continuation's turn is one too)
    gateway: str = ""  # the id of the gateway that drives it (its liveness says whether anyone still does)

    @property
    def request_id(self) -> str:
        return self.response["id"].removeprefix("resp_")

    def with_response(self, response: dict, turns: list[dict] | None = None) -> Stored:
        return replace(self, response=response, turns=self.turns if turns is None else turns)

    def fields(self) -> dict:
        record = {"response": self.response, "input_items": self.input_items, "turns": self.turns}
        return {"status": self.response["status"], "record": json.dumps(record, ensure_ascii=False)}


def _key(core: GatewayCore, owner: str, response_id: str) -> str:
    return core.names.response(owner, response_id)


async def put(core: GatewayCore, owner: str, stored: Stored) -> None:
    key = _key(core, owner, stored.response["id"])
    pipe = core.r.pipeline(transaction=True)  # born with its TTL
    about = {"reply_to": stored.reply_to, "session_id": stored.session_id, "gateway": stored.gateway}
    pipe.hset(key, mapping={**stored.fields(), **about})
    pipe.expire(key, core.s.responses_ttl_s)
    await pipe.execute()


async def update_running(core: GatewayCore, owner: str, stored: Stored) -> bool:
    """Write stored if the stored response still runs (not cancelled, deleted, expired or ended); True if written."""
    f = stored.fields()
    key = _key(core, owner, stored.response["id"])
    return bool(await core.r.eval(_UPDATE_RUNNING, 1, key, f["status"], f["record"]))


async def get(core: GatewayCore, owner: str, response_id: str, param: str = "response_id") -> Stored:
    """The stored response, or a 404 naming param (unknown, expired, deleted, or another key's look alike)."""
    raw = await core.r.hgetall(_key(core, owner, response_id))
    if not raw:
        raise NotFound(f"{param}: no response {response_id!r} (never stored, deleted, or expired)", param, "not_found")
    fields = {as_text(k): as_text(v) for k, v in raw.items()}
    data = json.loads(fields["record"])
    about = {k: fields.get(k, "") for k in ("reply_to", "session_id", "gateway")}
    return Stored(data["response"], data["input_items"], data["turns"], **about)


async def delete(core: GatewayCore, owner: str, response_id: str) -> None:
    if not await core.r.delete(_key(core, owner, response_id), core.names.response_events(owner, response_id)):
        raise NotFound(f"response_id: no response {response_id!r}", "response_id", "not_found")


def terminal_event(status: str) -> str:
    """The type of the event that ends a stream of a response ended so (cancelled too is a failure to answer)."""
    return f"response.{status}" if status in ("completed", "incomplete") else "response.failed"


async def append_events(core: GatewayCore, owner: str, response_id: str, events: list[dict], first: bool) -> None:
    """Append a background response's events to its log (first: the log is born here, with its TTL)."""
    key = core.names.response_events(owner, response_id)
    pipe = core.r.pipeline(transaction=True)
    for event in events:
        pipe.xadd(key, {EVENT_FIELD: json.dumps(event, ensure_ascii=False)})
    if first:
        pipe.expire(key, core.s.responses_ttl_s)
    await pipe.execute()


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


async def orphan_settled(core: GatewayCore, owner: str, stored: Stored) -> Stored:
    """stored, settled failed if it still runs under a gateway that is no longer live (nobody will end it)."""
    if stored.response["status"] not in RUNNING or stored.gateway in ("", core.id):
        return stored
    if stored.gateway in await aread_live(core.r, core.names, "gateway"):
        return stored
    error = {"code": "gateway_lost", "message": "the gateway driving this response stopped; send it again"}
    lost = stored.with_response(stored.response | {"status": "failed", "error": error})
    if await update_running(core, owner, lost):
        logger.warning("response %s: its gateway %s is gone; settled failed", lost.response["id"], stored.gateway)
        return lost
    return await get(core, owner, stored.response["id"])  # it changed meanwhile: what it is now
