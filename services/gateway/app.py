"""The gateway's FastAPI application: where its packages are put together (docs/architecture.md).

edge/ is what every HTTP request crosses first (middleware, API keys, the error shape, the OpenAPI document);
native/, openai/ and responses/ are the APIs; ops/ the probes, introspection and the dashboard; session/ and text/
the request's life, which neither API's shapes reach into.
"""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.conversation.routes import router as sessions_router
from services.gateway.edge import log_redaction, probe_log
from services.gateway.edge.auth import OPEN_PATHS, ApiKeyAuth
from services.gateway.edge.errors import GatewayError
from services.gateway.edge.handlers import gateway_error_handler, http_error_handler, validation_error_handler
from services.gateway.edge.middleware import BodyLimit, OpenRequestLimit, RequestIdHeader
from services.gateway.edge.openapi_doc import install as install_openapi
from services.gateway.native.routes import router as native_router
from services.gateway.native.tokenize import router as tokenize_router
from services.gateway.openai.routes import router as openai_router
from services.gateway.responses import takeover
from services.gateway.responses.routes import router as responses_router
from services.gateway.ops.dashboard import router as dashboard_router
from services.gateway.ops.health import router as health_router
from services.gateway.ops.introspection import router as introspection_router
from services.gateway.session.core import GatewayCore
from shared.text.model_files import model_display_name, resolve_model_dir
from shared.redis_io.redis_client import async_client
from shared.settings import GatewaySettings
from shared.text.tokenization import load_tokenizer, model_info

logger = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        info = model_info(resolve_model_dir(settings.model, settings.cache_dir))
        client = async_client(settings, settings.redis_pool_size, settings.redis_pool_timeout_s)
        app.state.core = core = GatewayCore(
            settings,
            client,
            load_tokenizer(info.model_dir),
            settings.model_name or model_display_name(settings.model),
            info.max_len,
        )
        await core.start()
        core.add_loop(takeover.sweep_loop(core), "responses-takeover")  # background responses of dead gateways
        # Everything loaded so far (the tokenizer, the app) lives as long as the process: keep it out of the cyclic
        # collector's full passes, which otherwise stop the event loop for 0.3 s and more (1 s on a busy machine)
        # to scan it again, every time enough new objects have survived.
        gc.freeze()
        logger.info("gateway %s ready for requests", core.id)
        yield
        await core.stop()

    log_redaction.install([*settings.api_keys, *settings.admin_api_keys])  # before any request is logged
    probe_log.install()  # a probe's polls logged when its answer changes (uvicorn's logging config keeps filters)
    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    app.add_exception_handler(GatewayError, gateway_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(
        OpenRequestLimit,
        limit=settings.max_open_requests,
        retry_after_s=settings.retry_after_s,
        per_key_limit=settings.max_open_requests_per_key,
    )  # the key id: set by ApiKeyAuth, below
    # nothing runs for a caller without a key
    app.add_middleware(ApiKeyAuth, keys=settings.api_keys, admin_keys=settings.admin_api_keys)
    app.add_middleware(RequestIdHeader)  # around everything: a refusal by any of the above carries one too
    if not settings.api_keys and not settings.admin_api_keys:
        logger.warning("no API keys are set (CONVEYOR_API_KEYS): every endpoint is open to anyone who can reach it")
    app.include_router(openai_router)
    app.include_router(responses_router)
    install_openapi(app, OPEN_PATHS)  # document the answers middlewares and validation really give
    routers = (introspection_router, dashboard_router, native_router, tokenize_router, sessions_router, health_router)
    for router in routers:
        app.include_router(router)
    return app
