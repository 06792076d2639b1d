"""Looking into the cluster: Prometheus metrics and the list of requests by state."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from services.gateway.auth import STATE_KEY
from services.gateway.core import GatewayCore
from shared.lifecycle import TERMINAL, State

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    core: GatewayCore = request.app.state.core
    body = await core.metrics.render(core.r, core.names)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/requests")
async def list_requests(request: Request, state: State | None = None, limit: int = Query(20, ge=1, le=100),
                        offset: int = Query(0, ge=0)):
    """Requests in one state (default: every live state), oldest first, with their layers. With API keys
    set, a caller sees only its own requests."""
    core: GatewayCore = request.app.state.core
    states = [state] if state is not None else [s for s in State if s not in TERMINAL]
    owner = getattr(request.state, STATE_KEY, None)
    ids: list[tuple[float, str]] = []
    for s in states:
        ids += [(score, rid.decode()) for rid, score in
                await core.r.zrange(core.names.state_set(s.value), 0, -1, withscores=True)]
    ids.sort()
    if not owner:  # no per-key filter: page by position, read only the page
        ids, offset_left = ids[offset:], 0
    else:
        offset_left = offset
    data, skipped = [], 0
    for _score, rid in ids:
        snap = await core.store.aread(core.r, rid)
        if snap is None or (owner and snap.layers["meta"].get("owner") != owner):
            continue
        if skipped < offset_left:
            skipped += 1
            continue
        data.append(snap.to_dict())
        if len(data) == limit:
            break
    more = len(data) == limit
    return {"data": data, "offset": offset, "limit": limit, "next_offset": offset + len(data) if more else None}
