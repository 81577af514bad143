"""The FastAPI application: routes, error format, middleware, metrics and the backend's lifetime."""
import gc
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST

from service.core import tracing
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.engine.backends import Backend
from service.engine.backends.local import LocalBackend
from service.pipeline.served import Pipelines
from service.protocol import grpc_server
from service.protocol.statistics import metrics_page

from . import error_responses
from .hot_routes import HotRoutes
from .middleware import ApiKey, BodyLimit, CancelOnDisconnect, HeadAsGet, RequestMetrics, TraceRequests
from .routes import (attention, classify, embed, expression, health, kserve, models, openai_embeddings, repository,
                     shared_memory)

log = logging.getLogger("vitserve")
DEMO_PAGE = (Path(__file__).parent / "static" / "index.html").read_text()


def create_app(settings: Settings | None = None, backend: Backend | None = None, start_when_loaded: bool = False,
               metrics: Metrics | None = None, grpc_shared_port: bool = False) -> FastAPI:
    """The service over `backend` (default: a LocalBackend, which reads the repository now, so that a missing
    or empty one fails before the server listens). Models load after start-up, so that /health/live answers at
    once; with `start_when_loaded` start-up itself waits for them (a Ray Serve replica takes requests once
    started). The gRPC server (settings.grpc_port) starts with it, its port shared with other processes' where
    `grpc_shared_port` (the process backend's HTTP workers)."""
    settings = settings or Settings()
    tracing.enable("http")
    metrics = metrics or Metrics()
    backend = backend or LocalBackend(settings, metrics)
    pipelines = Pipelines(backend, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        pipelines.open()
        grpc_front = None
        if settings.grpc_port:
            grpc_front = await grpc_server.start(pipelines, settings, metrics, grpc_shared_port)
        # requests make few reference cycles: collect less often, and never scan what start-up made
        # (docs/performance.md#service-overhead-raw-session-vs-http)
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000)
        if start_when_loaded:
            await backend.loaded()
        yield
        if grpc_front is not None:  # after uvicorn's drain: the calls under way finish, new ones are refused
            await grpc_front.stop(settings.request_timeout_s)
        await backend.close()
        pipelines.close()
        tracing.shut_down()

    app = FastAPIOffline(  # /docs and /redoc with their scripts served from a package: nothing from a CDN
        static_url="/docs/static", title="vitserve", version="0.1.0", lifespan=lifespan,
        # FastAPI's OpenTelemetry hooks ask for providers on every request; /metrics is Prometheus here
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
        description="Vision Transformer inference on ONNX Runtime: classification, facial expressions and "
                    "attention maps, with dynamic batching. Errors are JSON: "
                    '`{"error": {"code": ..., "message": ...}}`.',
    )
    app.state.settings, app.state.metrics, app.state.pipelines = settings, metrics, pipelines
    error_responses.install(app)
    # the busiest routes first: routes are matched in order
    for router in (classify.router, embed.router, kserve.router, openai_embeddings.router, expression.router,
                   attention.router, models.router, health.router, repository.router, shared_memory.router,
                   shared_memory.cuda_router):
        app.include_router(router)

    @app.get("/", include_in_schema=False)
    async def root(request: Request) -> Response:
        """The demo page for a browser; where things are for anything else (curl, scripts)."""
        if "text/html" in request.headers.get("accept", ""):
            return HTMLResponse(DEMO_PAGE)
        return JSONResponse({"name": "vitserve", "docs": "/docs", "models": "/models", "ready": "/health/ready"})

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus(request: Request) -> Response:
        return Response(metrics_page(metrics, pipelines), media_type=CONTENT_TYPE_LATEST)

    # the last added runs first: CORS answers preflights, metrics count every answer, the body limit comes
    # before the key (a refused key reads at most that much); the hot routes last, FastAPI's routing after them
    app.add_middleware(HotRoutes)
    app.add_middleware(CancelOnDisconnect)
    if settings.api_key is not None:
        app.add_middleware(ApiKey, key=settings.api_key.get_secret_value())
    app.add_middleware(BodyLimit, max_bytes=settings.max_upload_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "X-API-Key", "Authorization",
                                          "Inference-Header-Content-Length"],
                           expose_headers=["Retry-After", "Inference-Header-Content-Length"])
    if tracing.on():  # (OTEL_TRACES_EXPORTER=otlp) each request a span, around all the rest
        app.add_middleware(TraceRequests)
    app.add_middleware(HeadAsGet)  # outermost: every layer treats a HEAD as the GET it runs as
    return app
