"""The FastAPI application: routers, error format, middleware, metrics and the model pool's lifetime."""
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import errors
from .cache import AttentionCache
from .metrics import Metrics
from .pool import ModelPool
from .routers import attention, classify, expression, health, kserve, models
from .settings import Settings

log = logging.getLogger("vitserve")


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """413 for request bodies over the limit: at once from Content-Length, else while the body streams in,
    so an oversized upload is never buffered whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = errors.error_response(413, "too_large", f"the request body is over the {self.max_bytes}-byte limit")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await too_large(scope, receive, send)


class RequestMetrics:
    """Counts requests by route template, method and status, and times them."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def tracked_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(path, scope["method"], str(status)).inc()
            self.metrics.request_seconds.labels(path).observe(time.perf_counter() - start)


def create_app(settings: Settings | None = None, start_when_loaded: bool = False) -> FastAPI:
    """The service. Models load after start-up by default, so that /health/live answers at once; with
    `start_when_loaded` start-up itself waits for them (a Ray Serve replica takes requests once started)."""
    settings = settings or Settings()
    metrics = Metrics()
    pool = ModelPool(settings, metrics)
    pool.open()  # a missing or empty repository fails here, before the server listens

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.start()
        if start_when_loaded:
            await pool.loaded()
        yield
        await pool.close()

    app = FastAPI(
        title="vitserve", version="0.1.0", lifespan=lifespan,
        description="Vision Transformer inference on ONNX Runtime: classification, facial expressions and "
                    "attention maps, with dynamic batching. Errors are JSON: "
                    '`{"error": {"code": ..., "message": ...}}`.',
    )
    app.state.settings, app.state.metrics, app.state.pool = settings, metrics, pool
    app.state.attention_cache = AttentionCache(settings.attention_cache_items, settings.attention_cache_bytes,
                                               settings.attention_ttl_s)
    errors.install(app)
    for router in (classify.router, expression.router, attention.router, models.router, health.router,
                   kserve.router):
        app.include_router(router)

    @app.get("/", include_in_schema=False)
    async def root() -> dict:
        return {"name": "vitserve", "docs": "/docs", "models": "/models", "ready": "/health/ready"}

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics")
    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimit, max_bytes=settings.max_upload_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app
