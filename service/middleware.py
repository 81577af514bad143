"""ASGI middleware: the request-body limit, the API key, cancelling what a departed client asked for, and
per-route request metrics."""
import asyncio
import hmac
import time

from .http_errors import error_response
from .metrics import Metrics


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """413 for request bodies over the limit: at once from Content-Length, else while the body streams in,
    so an oversized upload is never buffered whole. The server reads and drops the rest of a refused body, so
    the client reads the answer (a client that asked `Expect: 100-continue`, as curl does, sends none of it)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def too_large(self):
        return error_response(413, "too_large", f"the request body is over the {self.max_bytes}-byte limit")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self.too_large()(scope, receive, send)
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
                await self.too_large()(scope, receive, send)


class ApiKey:
    """401 unless the request's X-API-Key header holds the key (compared in constant time), on every route but
    the open ones: health, metrics, the API docs, the index and the v2 server metadata. New routes are closed
    until opened here."""

    OPEN_PREFIXES = ("/health/", "/v2/health/", "/metrics", "/docs", "/redoc", "/openapi.json")
    OPEN_PATHS = ("/", "/v2")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.OPEN_PATHS or path.startswith(self.OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-api-key", b"")
        if hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        message = "wrong API key" if given else "this server needs an API key: send it in the X-API-Key header"
        await error_response(401, "unauthorized", message, {"WWW-Authenticate": 'APIKey header="X-API-Key"'},
                             path)(scope, receive, send)


class CancelOnDisconnect:
    """Cancels a request's handling when its client goes away once the body is in, so that its images leave the
    batcher's queue instead of being computed for nobody (a client that leaves mid-upload fails the body read).
    The handling runs in the request's own task, which a watcher cancels: no task of its own to start and wait for
    on every request's way."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_read = asyncio.Event()
        handling, gone = asyncio.current_task(), False

        async def tracked_receive():
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def watch():
            nonlocal gone
            await body_read.wait()
            if (await receive())["type"] == "http.disconnect":  # after the answer, uvicorn says so at once
                gone = True
                handling.cancel()  # it waits on something (the watcher runs only then): it stops there

        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, tracked_receive, send)
        except asyncio.CancelledError:
            if not gone:  # cancelled from outside (shutdown), not by the client leaving: pass it on
                raise
            handling.uncancel()  # the task goes on, for the server's own ending of the request
        finally:
            watcher.cancel()


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
