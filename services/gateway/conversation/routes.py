"""/v1/sessions: open, look at, list and close conversation sessions (README: Sessions).

A session is also opened by its first turn (a request with X-Session-ID): POST is for a client that wants the id
made up for it, or the limit checked before its first turn. A session belongs to the API key that opened it: for
another key it does not exist (404), as a request does not.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.conversation.turns import SESSION_ID, session_id_of
from services.gateway.edge.auth import caller
from services.gateway.edge.deps import Core
from services.gateway.edge.errors import Conflict, NotFound, Overloaded
from services.gateway.edge.openapi_doc import error_responses
from shared.wire.bus import write_event
from shared.wire.events import SessionClosed
from shared.state.sessions import Moved, close, open_session

router = APIRouter(tags=["Sessions"])


class SessionCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    session_id: str | None = Field(None, pattern=SESSION_ID.pattern, description="its id; none: one is made up")


def view(raw: dict) -> dict:
    """A session's record as the API shows it."""
    now = time.time()
    since = float(raw.get("state_since") or raw.get("created_at") or now)
    return {
        "id": raw.get("id"),
        "object": "session",
        "state": raw.get("state"),
        "reason": raw.get("reason") or None,
        "turns": int(raw.get("turns") or 0),
        "current_request_id": raw.get("current") or None,
        "worker_id": raw.get("worker") or None,
        "kv_blocks": int(raw.get("kv_blocks") or 0),
        "kv_tier": raw.get("tier") or None,
        "created_at": float(raw.get("created_at") or now),
        "state_since": since,
        "idle_s": round(now - since, 3) if raw.get("state") != "RUNNING" else 0.0,
    }


async def _found(core, request: Request, session_id: str) -> tuple[str, dict]:
    key = core.sessions.key(caller(request), session_id)
    raw = await core.sessions.get(key)
    if raw is None:
        raise NotFound(f"no session {session_id!r} (never opened, closed, or expired)", "session_id", "not_found")
    return key, raw


@router.post("/v1/sessions", status_code=201, responses=error_responses(400, 401, 409, 429))
async def create_session(request: Request, core: Core, body: SessionCreate | None = None) -> dict:
    session_id = (body.session_id if body else None) or session_id_of(request, None) or uuid.uuid4().hex
    key = core.sessions.key(caller(request), session_id)
    res = await core.sessions.amove(open_session(key, core.s.max_sessions_per_key))
    if res.status is Moved.LIMIT:
        raise Overloaded(
            f"session_id: this API key has {res.count} sessions, the most it may have "
            f"(max_sessions_per_key={core.s.max_sessions_per_key})",
            "session_id",
            "too_many_sessions",
            headers={"Retry-After": str(core.s.retry_after_s)},
        )
    if not res.applied:
        raise Conflict(f"session_id: the session {session_id!r} exists already", "session_id", "session_exists")
    return view(await core.sessions.get(key) or {"id": session_id, "state": "OPEN"})


@router.get("/v1/sessions", responses=error_responses(401))
async def list_sessions(request: Request, core: Core, limit: int = Query(20, ge=1, le=100)) -> dict:
    """The caller's sessions, most recently moved first."""
    ids = await core.sessions.list(caller(request), limit)
    data = [view(raw) for sid in ids if (raw := await core.sessions.get(core.sessions.key(caller(request), sid)))]
    return {"object": "list", "data": data}


@router.get("/v1/sessions/{session_id}", responses=error_responses(401, 404))
async def get_session(session_id: str, request: Request, core: Core) -> dict:
    _key, raw = await _found(core, request, session_id)
    return view(raw)


@router.delete("/v1/sessions/{session_id}", responses=error_responses(401, 404))
async def delete_session(session_id: str, request: Request, core: Core) -> dict:
    """Close it: its record is gone and the worker holding its KV releases it (a turn running finishes)."""
    key, _raw = await _found(core, request, session_id)
    res = await core.sessions.amove(close(key))
    if res.status is Moved.MISSING:
        raise NotFound(f"no session {session_id!r}", "session_id", "not_found")
    if res.worker:
        pipe = core.r.pipeline(transaction=False)
        write_event(
            pipe, core.names, core.names.worker_stream(res.worker), SessionClosed(session=key, worker_id=res.worker)
        )
        await pipe.execute()
    return {"id": session_id, "object": "session.deleted", "deleted": True}
