"""The OpenAPI document says what the gateway really answers.

FastAPI documents a 422 for every validated operation, but the gateway answers invalid input
with 400 in OpenAI's error shape; and the middlewares (API keys, open-request bound, body size)
answer on every route without the routes knowing. This fixes the document once for all routes,
so clients generated from it, and the API fuzzer, see the truth. The error shape every route answers in
(ErrorResponse) and the `responses` entries routes declare are here too.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # some errors add context (partial output, live services)
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


_ERROR_DOC = {
    400: "invalid request",
    401: "no or bad API key",
    404: "unknown model, request or session",
    409: "the session has a turn running (or exists already)",
    413: "body too large",
    429: "overloaded (see Retry-After)",
    503: "not ready",
    504: "timed out",
}


def error_responses(*codes: int) -> dict:
    """OpenAPI `responses` entries for these error statuses (all share the error shape)."""
    return {c: {"model": ErrorResponse, "description": _ERROR_DOC[c]} for c in codes}


def sse_or_json(model: type[BaseModel] | None, description: str) -> dict:
    """A 200 that is JSON (`model`) or, with "stream": true, Server-Sent Events."""
    entry: dict = {
        "description": description,
        "content": {"text/event-stream": {"schema": {"type": "string", "description": "SSE events"}}},
    }
    if model is not None:
        entry["model"] = model
    return {200: entry}


GENERATION_ERRORS = error_responses(400, 401, 404, 409, 413, 429, 503, 504)  # what a generation route can answer
UNBOUNDED_PATHS = ("/health", "/ready")  # OpenRequestLimit lets these through under any load
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {
    400: "invalid request",
    401: "no or bad API key",
    413: "body too large",
    429: "overloaded (see Retry-After)",
}


def _error(status: int) -> dict:
    return {"description": _DESCRIPTIONS[status], "content": {"application/json": {"schema": _ERROR_REF}}}


def _fix_operation(path: str, op: dict, open_paths: tuple[str, ...]) -> None:
    responses = op.setdefault("responses", {})
    validated = responses.pop("422", None) is not None
    wanted = []
    if validated or op.get("parameters") or op.get("requestBody"):
        wanted.append(400)
    if path not in open_paths:
        wanted.append(401)
    if op.get("requestBody"):
        wanted.append(413)
    if path not in UNBOUNDED_PATHS:
        wanted.append(429)
    for status in wanted:
        responses.setdefault(str(status), _error(status))


def install(app: FastAPI, open_paths: tuple[str, ...]) -> None:
    """Replace app.openapi with one that documents the gateway's real error answers. open_paths: those that take
    no API key (edge.auth.OPEN_PATHS), which never answer 401."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            if "ErrorResponse" not in schemas:
                error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(error.pop("$defs", {}))
                schemas["ErrorResponse"] = error
            for path, item in doc.get("paths", {}).items():
                for op in item.values():
                    _fix_operation(path, op, open_paths)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
