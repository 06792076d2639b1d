"""The live lifecycle dashboard: the page, its data, and its Server-Sent Events (issue 14).

  GET    /dashboard                         the page, with its login form (open: it holds no data)
  POST   /dashboard/login                   the key, in its Authorization header, kept in a dashboard-only cookie
  GET    /dashboard/static/{file}           its script and style (files of static/, no build step, no CDN)
  GET    /dashboard/api/config              what the page needs to know (trace link template, admin or not)
  GET    /dashboard/api/events              SSE: a snapshot of the in-flight requests, then live transitions
  GET    /dashboard/api/rows?ids=a,b        token counts of the rows the page shows or has not counted yet
  GET    /dashboard/api/requests/{id}       one request: layers, history, intervals, trace link
  DELETE /dashboard/api/requests/{id}       cancel it

Key rules are those of /v1/requests (services/gateway/edge/auth.py): a key sees its own requests, an admin key all.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from services.gateway.edge.auth import (
    DASHBOARD_PREFIX,
    KEY_COOKIE,
    bearer_token,
    is_admin,
    owned_snapshot,
    visible_owner,
)
from services.gateway.edge.deps import Core
from services.gateway.edge.errors import InvalidRequest, NotFound
from services.gateway.edge.sse import SseResponse
from services.gateway.ops.dashboard_data import detail, read_rows, snapshot
from services.gateway.ops.introspection import cancel_owned
from services.gateway.session.feed_hub import sse
from shared.state.lifecycle import TERMINAL, State

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

logger = logging.getLogger(__name__)

router = APIRouter(prefix=DASHBOARD_PREFIX, include_in_schema=False)

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "charts.js": "text/javascript"}
KEEPALIVE_S = 10.0  # an SSE comment this often keeps proxies from closing an idle stream
MAX_ROW_IDS = 200  # ids one /rows call may ask about (the rows on screen, and new rows not yet counted)


@router.get("")
async def page(request: Request):
    if request.url.query:
        # An old `?key=` link: the key is not taken (a link would plant its sender's key in whoever opens it), and
        # is dropped from the address bar and the history.
        return RedirectResponse(DASHBOARD_PREFIX, status_code=303)
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-store"})


@router.post("/login", status_code=204)
async def login(request: Request):
    """The page's login form: the key comes in the Authorization header (ApiKeyAuth checked it) and is kept where
    the page's own requests (fetch, EventSource) carry it. HttpOnly: the page's script never reads it back;
    SameSite=Strict: no other site's page sends it. No other site can log a browser in either: a cross-site
    request with an Authorization header needs a CORS preflight, which the gateway does not answer."""
    key = bearer_token(request.scope.get("headers") or [])
    if key is None:
        raise InvalidRequest(
            "send the key in the header 'Authorization: Bearer <key>'", "Authorization", "missing_api_key"
        )
    resp = Response(status_code=204)
    resp.set_cookie(KEY_COOKIE, key, httponly=True, samesite="strict", path=DASHBOARD_PREFIX)
    return resp


@router.get("/static/{name}")
async def static(name: str):
    if name not in STATIC_FILES:
        raise NotFound(f"no dashboard file {name}", "name", "not_found")
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])


@router.get("/api/config")
async def config(request: Request, core: Core):
    return {
        "trace_url_template": core.s.trace_url_template,
        "admin": is_admin(request),
        "states": [s.value for s in State],
        "terminal": sorted(s.value for s in TERMINAL),
        "max_row_ids": MAX_ROW_IDS,
    }


async def _stream(core: GatewayCore, owner: str | None):
    hub = core.feed_hub
    try:
        sub = await hub.subscribe(owner)  # before the snapshot: a transition made while it is read is not lost
    except redis.RedisError as e:
        logger.warning("dashboard stream refused: %r (the browser reconnects)", e)
        return
    try:
        yield sse("snapshot", await snapshot(core, owner, core.s.dashboard_max_rows))
        while True:
            try:
                kind, encoded = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if kind == "reset":  # it fell behind and its backlog was dropped: start it over
                yield sse("snapshot", await snapshot(core, owner, core.s.dashboard_max_rows))
            else:
                yield encoded
    finally:
        hub.unsubscribe(sub)  # the client left (the response is cancelled) or the gateway stops


@router.get("/api/events")
async def events(request: Request, core: Core):
    return SseResponse(
        _stream(core, visible_owner(request)),
        core.s.sse_write_timeout_s,
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


@router.get("/api/rows")
async def rows(request: Request, core: Core, ids: str = Query(..., description="comma-separated request ids")):
    wanted = [i for i in ids.split(",") if i]
    if not wanted or len(wanted) > MAX_ROW_IDS or any(len(i) > 64 or not i.isalnum() for i in wanted):
        raise InvalidRequest(f"ids must be 1 to {MAX_ROW_IDS} comma-separated request ids", "ids", "invalid_ids")
    return {"rows": await read_rows(core, wanted, visible_owner(request))}


@router.get("/api/requests/{request_id}")
async def request_detail(request_id: str, request: Request, core: Core):
    snap = await owned_snapshot(core, request, request_id)
    return detail(snap.to_dict(), core.s.trace_url_template)


@router.delete("/api/requests/{request_id}")
async def cancel(request_id: str, request: Request, core: Core):
    return await cancel_owned(core, request, request_id)
