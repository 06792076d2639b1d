"""API keys: `Authorization: Bearer <key>` on every endpoint but /health, when keys are set.

Keys come from the setting CONVEYOR_API_KEYS. A request is recorded with its caller's key id
(a hash prefix, never the key itself) and only that key may read or cancel it: anyone else
gets 404, the same answer as for an id that does not exist, so ids cannot be probed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Sequence

from services.gateway.errors import NotFound, Unauthorized, error_response

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # liveness probes carry no key
STATE_KEY = "api_key_id"  # where the caller's key id is put in the ASGI scope's state


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class ApiKeyAuth:
    """ASGI middleware: refuse (401) what carries no accepted key, before anything reads the body."""

    def __init__(self, app, keys: Sequence[str]):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.digests or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers") or [])
        if token is None:
            return await _refuse("no API key: send the header 'Authorization: Bearer <key>'", "missing_api_key",
                                 scope, receive, send)
        digest = hashlib.sha256(token.encode()).digest()
        # Compare against every key, in constant time each, so timing tells nothing about which matched.
        if not any([hmac.compare_digest(digest, d) for d in self.digests]):
            return await _refuse("invalid API key", "invalid_api_key", scope, receive, send)
        scope.setdefault("state", {})[STATE_KEY] = key_id(token)
        await self.app(scope, receive, send)


async def _refuse(message: str, code: str, scope, receive, send) -> None:
    err = Unauthorized(message, None, code, headers={"WWW-Authenticate": "Bearer"})
    await error_response(err)(scope, receive, send)


def caller(request) -> str:
    """The caller's key id ("" when the gateway has no keys)."""
    return getattr(request.state, STATE_KEY, "")


async def owned_snapshot(core, request, request_id: str):
    """The request's context if the caller may see it; else 404 (unknown and not-yours look alike)."""
    for prefix in ("chatcmpl-", "cmpl-"):  # the OpenAI API's response ids wrap the request id
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix):]
    snap = await core.store.aread(core.r, request_id)
    if snap is None or snap.layers["meta"].get("owner", "") != caller(request):
        raise NotFound(f"no request {request_id} (unknown, or its context expired)", "request_id", "not_found")
    return snap
