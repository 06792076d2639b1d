"""Probes: GET /health (the process lives) and GET /ready (Redis answers and every service kind has a live
instance). Both are let through the open-request limit under any load (edge.middleware.UNLIMITED_PATHS)."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter
from redis.exceptions import RedisError

from services.gateway.edge.deps import Core
from services.gateway.edge.errors import Unavailable
from services.gateway.edge.openapi_doc import error_responses

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready", responses=error_responses(503))  # no 401: a probe takes no key (edge.auth.OPEN_PATHS)
async def ready(core: Core):
    try:
        found = await core.ready(core.ops_r)  # the ops pool: a saturated request pool must not fail the probe
    except (RedisError, OSError) as e:  # any Redis failure means not ready
        raise Unavailable(f"redis unreachable: {e}", None, "redis_unavailable") from e
    missing = [s for s, n in found.items() if n == 0]
    if missing:
        raise Unavailable(f"no live {', '.join(missing)}", None, "not_ready", extra={"live": found})
    return {"status": "ready", "live": found}


@router.get("/version", responses=error_responses(401))
async def version():
    """The server's version, as vLLM's GET /version answers it."""
    return {"version": _VERSION}


@router.get("/load", responses=error_responses(401))
async def load(core: Core):
    """The requests this gateway is serving now (each choice counts), as vLLM's GET /load: what a load balancer
    in front of several gateways reads."""
    return {"server_load": len(core.handles)}


def _installed_version() -> str:
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


_VERSION = _installed_version()
