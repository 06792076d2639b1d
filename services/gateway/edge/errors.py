"""Client-facing errors: one JSON shape, {"error": {message, type, param, code}} (OpenAI's). Which one a request's
ending calls for is session.outcome's table; FastAPI's and Starlette's own errors are mapped in edge.handlers."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """Base of the gateway's errors; each maps to one HTTP status."""

    status = 500
    type = "internal_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        extra: dict | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.extra = extra or {}
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}
        }


class InvalidRequest(GatewayError):
    status, type = 400, "invalid_request_error"


class Unauthorized(GatewayError):
    status, type = 401, "authentication_error"


class NotFound(GatewayError):
    status, type = 404, "not_found_error"


class Conflict(GatewayError):
    status, type = 409, "conflict_error"


class Overloaded(GatewayError):
    status, type = 429, "rate_limit_error"


class BodyTooLarge(GatewayError):
    status, type = 413, "invalid_request_error"


class Unavailable(GatewayError):
    status, type = 503, "service_unavailable"


class RequestTimedOut(GatewayError):
    status, type = 504, "timeout"


class RequestFailed(GatewayError):
    status, type = 500, "server_error"


class RequestCancelled(GatewayError):
    status, type = 499, "cancelled"


def error_response(e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
