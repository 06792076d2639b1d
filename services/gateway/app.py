"""The gateway's HTTP API (FastAPI): /generate, request status and cancel, health and readiness."""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from redis.exceptions import RedisError
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.session.admission import OpenRequestLimit
from services.gateway.edge.auth import ApiKeyAuth, owned_snapshot
from services.gateway.session.core import GatewayCore
from services.gateway.edge import log_redaction
from services.gateway.ops.dashboard import router as dashboard_router
from services.gateway.ops.introspection import cancel_owned
from services.gateway.ops.introspection import router as introspection_router
from services.gateway.edge.errors import (BodyTooLarge, GatewayError, Unavailable, error_response,
                                          gateway_error_handler, http_error_handler, validation_error_handler)
from services.gateway.openai.routes import GENERATION_ERRORS
from services.gateway.openai.routes import router as openai_router
from services.gateway.openai.schemas import error_responses, sse_or_json
from services.gateway.edge.openapi_doc import install as install_openapi
from services.gateway.native import stream as native_serve
from services.gateway.session.request import GenerateRequest
from shared.model_files import model_display_name, resolve_model_dir
from shared.redis_client import async_client
from shared.settings import GatewaySettings
from shared.tokenization import load_tokenizer, model_info

logger = logging.getLogger(__name__)


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


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        info = model_info(resolve_model_dir(settings.model, settings.cache_dir))
        app.state.max_len = info.max_len
        client = async_client(settings, settings.redis_pool_size, settings.redis_pool_timeout_s)
        app.state.core = GatewayCore(settings, client, load_tokenizer(info.model_dir),
                                     settings.model_name or model_display_name(settings.model))
        await app.state.core.start()
        # Everything loaded so far (the tokenizer, the app) lives as long as the process: keep it out of the cyclic
        # collector's full passes, which otherwise stop the event loop for 0.3 s and more (1 s on a busy machine)
        # to scan it again, every time enough new objects have survived.
        gc.freeze()
        logger.info("gateway %s ready for requests", app.state.core.id)
        yield
        await app.state.core.stop()

    log_redaction.install([*settings.api_keys, *settings.admin_api_keys])  # before any request is logged
    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(GatewayError, gateway_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(OpenRequestLimit, limit=settings.max_open_requests, retry_after_s=settings.retry_after_s,
                       per_key_limit=settings.max_open_requests_per_key)  # the key id: set by ApiKeyAuth, below
    # outermost: nothing runs for a caller without a key
    app.add_middleware(ApiKeyAuth, keys=settings.api_keys, admin_keys=settings.admin_api_keys)
    if not settings.api_keys and not settings.admin_api_keys:
        logger.warning("no API keys are set (CONVEYOR_API_KEYS): every endpoint is open to anyone who can reach it")
    app.include_router(openai_router)
    install_openapi(app)  # document the answers middlewares and validation really give
    app.include_router(introspection_router)
    app.include_router(dashboard_router)

    @app.post("/generate", responses={**sse_or_json(None, "the output (JSON, or SSE with stream)"),
                                      **GENERATION_ERRORS})
    async def generate(body: GenerateRequest, request: Request):
        return await native_serve.generate(request, body)  # a request of its own per choice, n = 1 too (groups.py)

    @app.get("/v1/requests/{request_id}", responses=error_responses(401, 404))
    async def get_request(request_id: str, request: Request):
        core: GatewayCore = request.app.state.core
        snap = await owned_snapshot(core, request, request_id)
        return snap.to_dict()

    @app.delete("/v1/requests/{request_id}", responses=error_responses(401, 404))
    async def cancel_request(request_id: str, request: Request):
        return await cancel_owned(request.app.state.core, request, request_id)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses=error_responses(401, 503))
    async def ready(request: Request):
        try:
            found = await request.app.state.core.ready(request.app.state.core.ops_r)
        except (RedisError, OSError) as e:  # any Redis failure means not ready
            raise Unavailable(f"redis unreachable: {e}", None, "redis_unavailable") from e
        missing = [s for s, n in found.items() if n == 0]
        if missing:
            raise Unavailable(f"no live {', '.join(missing)}", None, "not_ready", extra={"live": found})
        return {"status": "ready", "live": found}

    return app
