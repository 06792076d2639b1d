"""FastAPI's and Starlette's own errors (validation, unknown paths, unreadable bodies) and the gateway's, answered
in the one error shape (edge.errors)."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.edge.errors import GatewayError, InvalidRequest, error_response
from services.gateway.session.request import MAX_NESTING


async def gateway_error_handler(_request: Request, e: GatewayError) -> JSONResponse:
    return error_response(e)


async def http_error_handler(_request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, a body that is not text) in the same shape."""
    if isinstance(e.__cause__, RecursionError):  # FastAPI's "error parsing the body": nested past Python's parser
        return error_response(
            InvalidRequest(
                f"the body nests too deeply to be read; a JSON value may nest at most {MAX_NESTING} levels",
                None,
                "too_deep",
            )
        )
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, kind)
    code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    body = {"error": {"message": str(e.detail), "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=e.status_code, headers=e.headers)


def _union_branch(part) -> bool:
    """pydantic names the branch of a union in the location ("prompt", "list[str]"): not a field name."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or part.endswith("]") or part.startswith(("constrained-", "function-"))
    )


async def validation_error_handler(_request: Request, e: RequestValidationError) -> JSONResponse:
    """Pydantic's errors, reduced to the first one, naming the field and the rule it broke."""
    err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request", "type": "invalid"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _union_branch(x)]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return error_response(
            InvalidRequest(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}", None, "invalid_json")
        )
    msg = err.get("msg", "invalid value")
    given = err.get("input")
    detail = f"{param}: {msg}" if param else msg
    if param and not isinstance(given, (dict, list)) and given is not None:
        detail += f" (got {given!r})"
    return error_response(InvalidRequest(detail, param, err.get("type", "invalid_value")))
