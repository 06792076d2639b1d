"""ASGI middleware at the gateway's edge, before any route runs: a body's size, how many HTTP requests are open, and
the X-Request-Id every response carries.

Both answer in the gateway's error shape (services.gateway.edge.errors) without the routes knowing.
"""

from __future__ import annotations

import uuid

from services.gateway.edge.auth import STATE_KEY
from services.gateway.edge.errors import BodyTooLarge, Overloaded, error_response

UNLIMITED_PATHS = ("/health", "/ready")  # probes must answer under any load
# The dashboard's page and short reads too: a saturated gateway is when it is needed. Its event stream is not
# exempt: each one holds a connection for as long as the page is open.
DASHBOARD_PREFIX, DASHBOARD_STREAM = "/dashboard", "/dashboard/api/events"


def unlimited(path: str) -> bool:
    """Requests the open-request limit lets through whatever the load."""
    return path in UNLIMITED_PATHS or (path.startswith(DASHBOARD_PREFIX) and path != DASHBOARD_STREAM)


class BodyLimit:
    """ASGI middleware: refuse bodies over the limit (413) before anything parses them. A body without a
    Content-Length (chunked) is read here whole, up to the limit, before the app sees any of it: one crossing the
    limit is refused and never run (handing the app a truncated body ran a request whose client was told 413)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = BodyTooLarge(f"the body exceeds {self.max_bytes} bytes", None, "body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was whole: no one to answer
                return None
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await error_response(too_large)(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if handed:  # after the body: what the server says next (the disconnect the handlers watch for)
                return await receive()
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class OpenRequestLimit:
    """ASGI middleware: at most `limit` HTTP requests in progress, and at most `per_key_limit` of one API key
    (its id is in the scope's state, put there by ApiKeyAuth, which runs first); more get 429 at once."""

    def __init__(self, app, limit: int, retry_after_s: int, per_key_limit: int | None = None):
        self.app, self.limit, self.retry_after_s, self.per_key_limit = app, limit, retry_after_s, per_key_limit
        self.open = 0
        self.open_by_key: dict[str, int] = {}  # only keys with requests open: bounded by `limit`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or unlimited(scope.get("path", "")):
            return await self.app(scope, receive, send)
        key = (scope.get("state") or {}).get(STATE_KEY) or ""
        busy = None
        if self.open >= self.limit:
            busy = Overloaded(
                f"the gateway is serving {self.open} requests (limit {self.limit}); retry after {self.retry_after_s} s",
                None,
                "too_many_open_requests",
            )
        elif key and self.per_key_limit is not None and self.open_by_key.get(key, 0) >= self.per_key_limit:
            busy = Overloaded(
                f"this API key has {self.open_by_key[key]} requests open on this gateway (limit "
                f"{self.per_key_limit}, CONVEYOR_MAX_OPEN_REQUESTS_PER_KEY); retry after "
                f"{self.retry_after_s} s",
                None,
                "too_many_open_requests_for_key",
            )
        if busy is not None:
            busy.headers = {"Retry-After": str(self.retry_after_s)}
            return await error_response(busy)(scope, receive, send)
        self.open += 1
        if key:
            self.open_by_key[key] = self.open_by_key.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            if key:
                left = self.open_by_key[key] - 1
                if left:
                    self.open_by_key[key] = left
                else:
                    del self.open_by_key[key]


class RequestIdHeader:
    """ASGI middleware: every response carries X-Request-Id, as vLLM's do. A generation's is its request id (set by
    its route); any other echoes the client's own X-Request-Id (when it is a short printable token) or gets a new
    one, so a client can quote it whatever it called, a refusal (401, 413, 429) included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = (
            given if 0 < len(given) <= 128 and given.isascii() and given.strip() == given and b" " not in given else b""
        )

        async def with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid or uuid.uuid4().hex.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_id)
