"""API keys: `Authorization: Bearer <key>` on every endpoint but /health, when keys are set.

Keys come from the setting CONVEYOR_API_KEYS. A request is recorded with its caller's key id
(a hash prefix, never the key itself) and only that key may read or cancel it: anyone else
gets 404, the same answer as for an id that does not exist, so ids cannot be probed. An admin key
(CONVEYOR_ADMIN_API_KEYS) is accepted too, and may read, list and cancel every request.

A browser cannot put a header on a page load or an EventSource, so under /dashboard (only) the key may also come
as `?key=` (the page then keeps it in an HttpOnly, SameSite=Strict cookie scoped to /dashboard and drops it from
the address) or from that cookie. The rules are the same whichever way it comes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from http.cookies import CookieError, SimpleCookie
from typing import Sequence
from urllib.parse import parse_qs

from services.gateway.errors import NotFound, Unauthorized, error_response

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # liveness probes carry no key
STATE_KEY = "api_key_id"  # where the caller's key id is put in the ASGI scope's state
ADMIN_STATE_KEY = "api_key_admin"  # ... and whether it is an admin key
DASHBOARD_PREFIX = "/dashboard"  # the only paths that take the key from a query parameter or a cookie
KEY_COOKIE = "conveyor_dashboard_key"


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def dashboard_token(scope) -> str | None:
    """The key a browser sent to a /dashboard path: `?key=` first (opening the page), else the page's cookie."""
    query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
    if query.get("key") and query["key"][0].strip():
        return query["key"][0].strip()
    for name, value in scope.get("headers") or []:
        if name.lower() == b"cookie":
            try:
                jar = SimpleCookie(value.decode("latin-1"))
            except CookieError:
                return None  # a malformed cookie header carries no key
            if KEY_COOKIE in jar and jar[KEY_COOKIE].value:
                return jar[KEY_COOKIE].value
    return None


class ApiKeyAuth:
    """ASGI middleware: refuse (401) what carries no accepted key, before anything reads the body."""

    def __init__(self, app, keys: Sequence[str], admin_keys: Sequence[str] = ()):
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.admin_digests = [hashlib.sha256(k.encode()).digest() for k in admin_keys]

    async def __call__(self, scope, receive, send):
        path = scope.get("path") or ""
        if scope["type"] != "http" or not (self.digests or self.admin_digests) or path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers") or [])
        if token is None and path.startswith(DASHBOARD_PREFIX):
            token = dashboard_token(scope)
        if token is None:
            return await _refuse("no API key: send the header 'Authorization: Bearer <key>'", "missing_api_key",
                                 scope, receive, send)
        digest = hashlib.sha256(token.encode()).digest()
        # Compare against every key, in constant time each, so timing tells nothing about which matched.
        admin = [hmac.compare_digest(digest, d) for d in self.admin_digests]
        plain = [hmac.compare_digest(digest, d) for d in self.digests]
        if not any(admin + plain):
            return await _refuse("invalid API key", "invalid_api_key", scope, receive, send)
        state = scope.setdefault("state", {})
        state[STATE_KEY], state[ADMIN_STATE_KEY] = key_id(token), any(admin)
        await self.app(scope, receive, send)


async def _refuse(message: str, code: str, scope, receive, send) -> None:
    err = Unauthorized(message, None, code, headers={"WWW-Authenticate": "Bearer"})
    await error_response(err)(scope, receive, send)


def caller(request) -> str:
    """The caller's key id ("" when the gateway has no keys)."""
    return getattr(request.state, STATE_KEY, "")


def is_admin(request) -> bool:
    return bool(getattr(request.state, ADMIN_STATE_KEY, False))


def visible_owner(request) -> str | None:
    """Whose requests the caller may see: its key id, or None for all (an admin key, or a gateway without keys)."""
    return None if is_admin(request) or not caller(request) else caller(request)


async def owned_snapshot(core, request, request_id: str):
    """The request's context if the caller may see it; else 404 (unknown and not-yours look alike)."""
    for prefix in ("chatcmpl-", "cmpl-"):  # the OpenAI API's response ids wrap the request id
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix):]
    snap = await core.store.aread(core.ops_r, request_id)
    if snap is None or (not is_admin(request) and snap.layers["meta"].get("owner", "") != caller(request)):
        raise NotFound(f"no request {request_id} (unknown, or its context expired)", "request_id", "not_found")
    return snap
