"""The FastAPI app: OpenAI-compatible routes, API-key check, /health, /metrics, /tokenize,
/detokenize, /version and the OpenAPI document (/openapi.json, /docs)."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from blockspec.config import ConfigError, EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.outputs import RequestOutput
from blockspec.parallel.driver import make_engine
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.body import MAX_BODY_BYTES, parse_body
from blockspec.server.errors import APIError, install_error_handlers
from blockspec.server.extra_routes import UtilityRoutes, server_version
from blockspec.server.logs import RequestLogger, StatsLogger
from blockspec.server.metrics import RefusedRequestsMiddleware, ServerMetrics
from blockspec.server.openapi import SchemaBook
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest
from blockspec.server.serving import OpenAIServing

__all__ = ["MAX_BODY_BYTES", "APIKeyMiddleware", "build_app", "parse_body"]


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer SSE and hide disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # NOTE: constant-time comparison: the key must not leak through response timing.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            if not self._authorized(scope):
                err = APIError("invalid or missing API key (expected 'Authorization: Bearer "
                               "<key>')", status=401, code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine_or_config: LLMEngine | EngineConfig, served_model_name: str,
              api_key: str | None = None, log_requests: bool = True,
              log_stats_interval: float | None = 10.0) -> FastAPI:
    """The engine thread starts and stops with the app's lifespan (uvicorn runs it).
    `log_requests`: a log line per finished request; `log_stats_interval`: seconds between
    engine stats lines while busy (None: none)."""
    config = engine_or_config.config if isinstance(engine_or_config, LLMEngine) \
        else engine_or_config
    if config.synthetic_acceptance is not None:
        raise ConfigError("synthetic acceptance is benchmark-only (its output is not the "
                          "target's): it is never served")
    engine = engine_or_config if isinstance(engine_or_config, LLMEngine) \
        else make_engine(config)
    metrics = ServerMetrics(lambda: async_engine.stats)  # NOTE: late-bound, defined next line
    hooks = [metrics.on_finished] + ([RequestLogger().on_finished] if log_requests else [])
    stats_log = StatsLogger(log_stats_interval) if log_stats_interval else None

    def on_finished(out: RequestOutput) -> None:
        for hook in hooks:
            hook(out)

    async_engine = AsyncEngine(engine, on_finished=on_finished,
                               on_iteration=stats_log.tick if stats_log else None)
    serving = OpenAIServing(async_engine, served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    # NOTE: redirect_slashes=False: "/v1/completions/" is a JSON 404, not a 307 with an empty
    # body that clients would follow (or fail on) without a word.
    app = FastAPI(title="blockspec", version=server_version(), lifespan=lifespan,
                  redoc_url=None, redirect_slashes=False)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = served_model_name
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RefusedRequestsMiddleware, metrics=metrics)  # NOTE: outside the key check
    book = SchemaBook()
    book.install(app)
    _add_ops_routes(app, async_engine, metrics)
    _add_openai_routes(app, serving, engine, book)
    UtilityRoutes(async_engine, serving).register(app, book)
    return app


def _add_ops_routes(app: FastAPI, async_engine: AsyncEngine, metrics: ServerMetrics) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"], operation_id="health")
    async def health(request: Request) -> Response:
        resp = JSONResponse({"status": "ok"}) if async_engine.alive else \
            APIError("engine is not running", status=503, type="server_error").response()
        if request.method == "HEAD":  # the same status, no body
            return Response(status_code=resp.status_code, media_type=resp.media_type)
        return resp

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, engine: LLMEngine,
                       book: SchemaBook) -> None:
    created = int(time.time())

    def model_card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created,
                "owned_by": "blockspec", "root": engine.config.model,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        serving.check_model(model_id)
        return JSONResponse(model_card())

    @app.post("/v1/completions", openapi_extra=book.body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.completion(await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=book.body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await parse_body(request, ChatCompletionRequest), request)
