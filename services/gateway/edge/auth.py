"""API keys: `Authorization: Bearer <key>` on every endpoint but the probes (/health, /ready), when keys are set.

Keys come from the setting CONVEYOR_API_KEYS. A request is recorded with its caller's key id
(a hash prefix, never the key itself) and only that key may read or cancel it: anyone else
gets 404, the same answer as for an id that does not exist, so ids cannot be probed. An admin key
(CONVEYOR_ADMIN_API_KEYS) is accepted too, and may read, list and cancel every request.

A browser cannot put a header on a page load or an EventSource, so under /dashboard (only) the key may also come
from a cookie: the page's login form sends it once in the header to POST /dashboard/login, which keeps it in an
HttpOnly, SameSite=Strict cookie scoped to /dashboard. Never from the address (`?key=`): a link would plant its
sender's key in whoever opens it, and the access log would keep it. The page itself and its static files hold no
data and are open (the login form is on the page). The rules are the same whichever way the key comes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from http.cookies import CookieError, SimpleCookie
from typing import Sequence

from services.gateway.edge.errors import NotFound, Unauthorized, error_response

logger = logging.getLogger(__name__)

# The probes carry no key. A Kubernetes probe (or a load balancer's health check) is an HTTP GET written in the
# deployment's spec, where a key would sit in plain text, and vLLM checks keys only under /v1, leaving /health open;
# so a readiness probe that needs a key is itself a defect: `conveyor up`'s own wait for /ready got 401s and shut
# the cluster down at --ready-timeout while it was serving (issue 28). /ready tells only whether this gateway
# would serve (if not, why) and how many instances of each service kind are live: no request, output or key.
OPEN_PATHS = ("/health", "/ready")
STATE_KEY = "api_key_id"  # where the caller's key id is put in the ASGI scope's state
ADMIN_STATE_KEY = "api_key_admin"  # ... and whether it is an admin key
DASHBOARD_PREFIX = "/dashboard"  # the only paths that take the key from a cookie
DASHBOARD_OPEN = (DASHBOARD_PREFIX, f"{DASHBOARD_PREFIX}/")  # the page: its login form, no data
DASHBOARD_STATIC = f"{DASHBOARD_PREFIX}/static/"  # its script and style, no data
KEY_COOKIE = "conveyor_dashboard_key"


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def open_path(path: str) -> bool:
    """Paths served without a key: the probes, and the dashboard's page and static files (no data)."""
    return path in OPEN_PATHS or path in DASHBOARD_OPEN or path.startswith(DASHBOARD_STATIC)


def dashboard_token(scope) -> str | None:
    """The key a browser's dashboard page sends without a header: its cookie (set by POST /dashboard/login)."""
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
        if scope["type"] != "http" or not (self.digests or self.admin_digests) or open_path(path):
            return await self.app(scope, receive, send)
        token = bearer_token(scope.get("headers") or [])
        if token is None and path.startswith(DASHBOARD_PREFIX):
            token = dashboard_token(scope)
        if token is None:
            return await _refuse(
                "no API key: send the header 'Authorization: Bearer <key>'", "missing_api_key", scope, receive, send
            )
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
    for prefix in ("chatcmpl-", "cmpl-", "resp_"):  # the OpenAI API's response ids wrap the request id
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix) :]
    snap = await core.store.aread(core.ops_r, request_id)
    if snap is None or (not is_admin(request) and snap.layers["meta"].get("owner", "") != caller(request)):
        raise NotFound(f"no request {request_id} (unknown, or its context expired)", "request_id", "not_found")
    return snap
