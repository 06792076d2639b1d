"""Looking into the cluster: Prometheus metrics, the list of requests by state, one request's context
(GET /v1/requests/{id}) and its cancel (DELETE)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from services.gateway.edge.auth import owned_snapshot, visible_owner
from services.gateway.edge.deps import Core
from services.gateway.edge.openapi_doc import error_responses
from services.gateway.session.groups import members
from shared.state.lifecycle import TERMINAL, State

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

router = APIRouter()


async def ids_in_states(core: GatewayCore, owner: str | None, states: list[State]) -> list[tuple[float, str]]:
    """(time it entered its state, request id) of the requests in `states` that `owner` may see (None: all),
    oldest first, from the state-set and per-owner indexes (no SCAN)."""
    pipe, names = core.ops_r.pipeline(transaction=False), core.names
    for p in names.all_partitions:  # each partition's sets are on a slot of their own: one read each
        for s in states:
            if owner:
                # The caller's requests in state s: ZINTER of its owner index (weight 0) and the state set (weight
                # 1), so each keeps its time of entering s, as without keys. Redis walks the smaller of the two
                # sets, so another key's requests cost nothing here; no temporary key is left behind
                # (ZINTERSTORE would need one, and its expiry).
                pipe.zinter({names.owner_index(p, owner): 0, names.state_set(p, s.value): 1}, withscores=True)
            else:
                pipe.zrange(names.state_set(p, s.value), 0, -1, withscores=True)
    return sorted((score, rid.decode()) for members in await pipe.execute() for rid, score in members)


@router.get("/metrics", response_class=Response)
async def metrics(core: Core) -> Response:
    body = await core.metrics.render(core.ops_r, core.names)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/requests")
async def list_requests(
    request: Request,
    core: Core,
    state: State | None = None,
    limit: int = Query(20, ge=1, le=100),
    offset: int = Query(0, ge=0),
):
    """Requests in one state (default: every live state), oldest first, with their layers. With API keys
    set, a caller sees only its own requests (an admin key: every request)."""
    states = [state] if state is not None else [s for s in State if s not in TERMINAL]
    ids = await ids_in_states(core, visible_owner(request), states)
    data = []
    for _score, rid in ids[offset : offset + limit]:  # at most `limit` contexts read
        snap = await core.store.aread(core.ops_r, rid)
        if snap is not None:  # expired meanwhile
            data.append(snap.to_dict())
    more = len(ids) > offset + limit
    return {"data": data, "offset": offset, "limit": limit, "next_offset": offset + limit if more else None}


async def cancel_owned(core: GatewayCore, request: Request, request_id: str) -> dict:
    """Cancel a request the caller may see (404 otherwise): DELETE /v1/requests/{id} and the dashboard's."""
    snap = await owned_snapshot(core, request, request_id)
    request_id = snap.request_id
    cancelled = False
    for rid in await members(core, snap.layers["meta"], request_id):  # a choice of n > 1: the whole request
        cancelled = await core.cancel(rid, "client_cancel", snap.layers["meta"].get("reply_to", "")) or cancelled
    after = await core.store.aread(core.ops_r, request_id)
    return {
        "request_id": request_id,
        "cancelled": cancelled,
        "state": after.state.value if after and after.state else None,
    }


@router.get("/v1/requests/{request_id}", responses=error_responses(401, 404))
async def get_request(request_id: str, request: Request, core: Core):
    snap = await owned_snapshot(core, request, request_id)
    return snap.to_dict()


@router.delete("/v1/requests/{request_id}", responses=error_responses(401, 404))
async def cancel_request(request_id: str, request: Request, core: Core):
    return await cancel_owned(core, request, request_id)
