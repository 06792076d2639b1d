"""A request's conversation session: which one it belongs to, starting its turn, ending it.

The session comes from the `session_id` body field, or the `X-Session-ID` header (the name AIPerf and Dynamo
clients send), or `X-Correlation-ID`. A turn starts before its request is created: the session moves to RUNNING
with the turn's request id (shared.state.sessions), so a second turn meanwhile gets a 409, and the worker that kept the
conversation's KV after the last turn is handed to the scheduler as the place for this one. A turn that ends with
its KV kept was paused by its worker already; any other end (failed, cancelled, timed out, nothing kept) moves the
session back to OPEN here. A gateway that dies mid-turn ends nothing: the next turn finds the session RUNNING
over a request that has ended, and takes it over (fenced on that request id).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from services.gateway.edge.errors import Conflict, InvalidRequest, Overloaded
from shared.wire.events import Completed
from shared.state.lifecycle import TERMINAL
from shared.state.sessions import Moved, begin_turn, end_turn

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle

logger = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
HEADERS = ("x-session-id", "x-correlation-id")


def session_id_of(request: Request, given: str | None) -> str | None:
    """The request's session id (body field first, then the headers), checked; None when it has none."""
    value = given
    param = "session_id"
    if value is None:
        for header in HEADERS:
            if (value := request.headers.get(header)) is not None:
                param = header
                break
    if value is None:
        return None
    if not SESSION_ID.fullmatch(value):
        raise InvalidRequest(
            f"{param}: a session id is 1 to 128 of the characters A-Z a-z 0-9 . _ : @ - (got {value[:40]!r})",
            param,
            "invalid_session_id",
        )
    return value


async def begin(core: GatewayCore, owner: str, session_id: str, request_id: str) -> tuple[str, str]:
    """Start a turn (the session is created when new) -> (the session's key, the worker holding its KV or "").
    Raises Conflict while another turn of it runs, Overloaded when the owner has too many sessions."""
    key = core.sessions.key(owner, session_id)
    res = await core.sessions.amove(begin_turn(key, request_id, core.s.max_sessions_per_key))
    if res.status is Moved.REFUSED and res.current and await _ended(core, res.current):
        res = await core.sessions.amove(begin_turn(key, request_id, core.s.max_sessions_per_key, res.current))
    if res.status is Moved.LIMIT:
        raise Overloaded(
            f"session_id: this API key has {res.count} sessions, the most it may have "
            f"(max_sessions_per_key={core.s.max_sessions_per_key}); close one (DELETE /v1/sessions/{{id}}) or "
            "wait for idle ones to expire",
            "session_id",
            "too_many_sessions",
            headers={"Retry-After": str(core.s.retry_after_s)},
        )
    if not res.applied:
        raise Conflict(
            f"session_id: the session {session_id!r} has a turn running (request {res.current}); "
            "send the next turn once it has ended",
            "session_id",
            "session_busy",
        )
    return key, res.worker


async def _ended(core: GatewayCore, request_id: str) -> bool:
    state = await core.r.hget(core.names.layer(request_id, "meta"), "state")
    return state is None or state.decode() in TERMINAL


def kept_by_worker(handle: RequestHandle) -> bool:
    """Whether the turn ended with its worker keeping the KV (and so pausing the session itself)."""
    return isinstance(handle.ended, Completed) and handle.ended.session_blocks > 0


async def end(core: GatewayCore, handle: RequestHandle) -> None:
    """The turn ended without its KV kept: the session is OPEN for its next turn (fenced on this turn)."""
    res = await core.sessions.amove(end_turn(handle.session, handle.request_id))
    if res.status not in (Moved.APPLIED, Moved.FENCED, Moved.MISSING):
        logger.info("ending the turn %s of a session: %s (state %s)", handle.request_id, res.status.value, res.state)
