"""The OpenAPI document says what the gateway really answers.

FastAPI documents a 422 for every validated operation, but the gateway answers invalid input
with 400 in OpenAI's error shape; and the middlewares (API keys, open-request bound, body size)
answer on every route without the routes knowing. This fixes the document once for all routes,
so clients generated from it, and the API fuzzer, see the truth.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.gateway.edge.auth import OPEN_PATHS
from services.gateway.openai.schemas import ErrorResponse

UNBOUNDED_PATHS = ("/health", "/ready")  # OpenRequestLimit lets these through under any load
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {400: "invalid request", 401: "no or bad API key", 413: "body too large",
                 429: "overloaded (see Retry-After)"}


def _error(status: int) -> dict:
    return {"description": _DESCRIPTIONS[status], "content": {"application/json": {"schema": _ERROR_REF}}}


def _fix_operation(path: str, op: dict) -> None:
    responses = op.setdefault("responses", {})
    validated = responses.pop("422", None) is not None
    wanted = []
    if validated or op.get("parameters") or op.get("requestBody"):
        wanted.append(400)
    if path not in OPEN_PATHS:
        wanted.append(401)
    if op.get("requestBody"):
        wanted.append(413)
    if path not in UNBOUNDED_PATHS:
        wanted.append(429)
    for status in wanted:
        responses.setdefault(str(status), _error(status))


def install(app: FastAPI) -> None:
    """Replace app.openapi with one that documents the gateway's real error answers."""

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
                    _fix_operation(path, op)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
